"""PyTorch DDP (gloo) on the same models, batches and ranks as bench/data_parallel.py, for the
scaling table beside backplan. Launch it the same way (mpiexec starts the ranks; mpi4py tells
each its rank, then gloo connects them over TCP on this host):

    OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 mpiexec -n 2 -bind-to core \\
        python -m backplan.bench.data_parallel_torch --model mlp

Rounds interleave the DDP step (forward, backward, DDP's bucketed allreduces overlapped with the
backward) and the same step under no_sync() (compute alone); rank 0 prints their medians, in
wall time and in the process's CPU time per call (gloo's threads included).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from backplan.bench.data_parallel import lockstep_medians
from backplan.bench.models import MODELS
from backplan.bench.torch_import import module_of

PORT = 29517


def main(argv=None) -> int:
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    parser = argparse.ArgumentParser(description="PyTorch DDP step time (gloo)")
    parser.add_argument("--model", choices=("mlp", "transformer"), default="mlp")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(PORT))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    spec = MODELS[args.model]
    data = spec.make_inputs(spec.config, seed=0).cast(np.float32)
    ddp = torch.nn.parallel.DistributedDataParallel(module_of(args.model, data.params))
    batch = tuple(torch.from_numpy(b) for b in data.batch(True))

    def step():
        ddp.zero_grad(set_to_none=True)
        ddp(*batch).backward()

    def compute():
        with ddp.no_sync():
            step()

    for _ in range(5):
        step()
    cpu: dict = {"step": [], "compute": []}
    calls = {
        "step": _process_timed(step, cpu["step"]),
        "compute": _process_timed(compute, cpu["compute"]),
    }
    medians = lockstep_medians(calls, args.rounds, args.repeats)
    if rank == 0:
        exposed = max(medians["step"] - medians["compute"], 0.0)
        step_cpu, compute_cpu = (float(np.median(cpu[k])) * 1e3 for k in ("step", "compute"))
        print(
            f"torch DDP gloo  {args.model}  ranks {size}  rows/rank {batch[0].shape[0]}\n"
            f"step {medians['step'] * 1e3:.2f} ms  compute alone {medians['compute'] * 1e3:.2f} "
            f"ms  step - compute {exposed * 1e3:.2f} ms\n"
            f"CPU per call (the process's, gloo's threads included): step {step_cpu:.2f} ms  "
            f"compute {compute_cpu:.2f} ms"
        )
    dist.destroy_process_group()
    return 0


def _process_timed(call, seconds: list):
    """call, recording the process's CPU seconds of each run in seconds: DDP's allreduces run
    on gloo's threads, which this thread's clock would leave out."""

    def run():
        start = time.process_time()
        call()
        seconds.append(time.process_time() - start)

    return run


if __name__ == "__main__":
    raise SystemExit(main())
