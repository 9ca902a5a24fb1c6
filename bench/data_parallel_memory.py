"""What one rank of a data-parallel step really holds against what explain prints for it
(distributed/rank_peak.py), measured from outside: the growth of peak resident memory over one
call of the loop, VmHWM after the call less VmRSS before it (reset by writing 5 to
/proc/self/clear_refs), against the printed per-rank peak less what is held between calls.
Run under mpiexec with glibc told to map every block and return it when freed:

    MALLOC_MMAP_THRESHOLD_=0 MALLOC_TRIM_THRESHOLD_=0 OPENBLAS_NUM_THREADS=1 \\
        mpiexec -n 2 python -m backplan.bench.data_parallel_memory --step train

Steps: "plain" (`loss, grads = step(params, x, y)`), "train" (adam, unsharded) and "zero"
(adam, ZeRO-1). The model is the bench mlp's layers at --width (2048: 23 MB of float32
parameters; the adam step's update writes its new parameters and state into the outputs its
workspace kept from the call before the loop's, so a call grows by kilobytes, as explain says). The calls measured run what
the step runs by default: on one node the sums in the node's shared window (the plan writing
into it), with BACKPLAN_DP_REDUCTION=mpi or across nodes the compiled driver starting the
allreduces (waited for first); with BACKPLAN_CHECK_MEMORY=1 the same on the node's window (on
the MPI path the buckets started after the call), the checked mode's counted peak printed
beside (it equals explain's counted figure to the byte).
"""

from __future__ import annotations

import argparse
import contextlib

import numpy as np

import backplan as bp
import backplan.distributed as bpd
from backplan.bench.internals import checking, measure
from backplan.bench.memory import proc_status_bytes
from backplan.bench.models import mlp


def model(width: int, batch: int, rank: int):
    config = {"n_in": 784, "width": width, "depth": 2, "n_out": 10, "batch": batch}
    data = mlp.make_inputs(config, seed=0).cast(np.float32)
    params = {k: bp.tensor(v, requires_grad=True) for k, v in data.params.items()}
    return params, tuple(bp.tensor(b) for b in data.batch(True))


def one_call(call, measurement):
    """(VmHWM after the call less VmRSS before it, the checked mode's counted peak or None).
    measurement: the checked mode's, open since the first call (it counts what earlier calls
    left allocated), or None."""
    with open("/proc/self/clear_refs", "w") as file:
        file.write("5")
    before = proc_status_bytes("VmRSS")
    if measurement is not None:
        measurement.restart_peak()
    call()
    growth = proc_status_bytes("VmHWM") - before
    return growth, None if measurement is None else measurement.peak


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step", choices=("plain", "train", "zero"), default="train")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--calls", type=int, default=3, help="calls measured, one at a time")
    args = parser.parse_args(argv)
    rank, size = bpd.init()
    params, batch = model(args.width, args.batch, rank)
    vg = bp.value_and_grad(mlp.loss)
    state = None
    if args.step == "plain":
        step = bpd.data_parallel(vg)
        loop = {"params": params}

        def call():  # `loss, grads = step(params, x, y)`: the last results bound meanwhile
            loop["results"] = step(params, *batch)

        waiter = step
    else:
        step = bpd.data_parallel(
            vg, optimizer=bp.optim.adam(1e-3), shard_optimizer=args.step == "zero"
        )
        loop = {"params": params, "state": step.init(params)}

        def call():
            loop["params"], loop["state"], loop["loss"] = step(
                loop["params"], loop["state"], *batch
            )

        waiter = step.step
    with contextlib.ExitStack() as stack:
        measurement = stack.enter_context(measure()) if checking() else None
        for _ in range(4):
            call()
        waiter.wait_for_driver(loop["params"], *batch, timeout=600)
        for _ in range(3):
            call()
        measured = [one_call(call, measurement) for _ in range(args.calls)]
    if args.step == "plain":
        report = step.explain(params, *batch)
    else:
        state = loop["state"]
        report = step.explain(loop["params"], state, *batch)
    peak = report.rank_peak
    growth = [m[0] for m in measured]
    counted = [m[1] for m in measured]
    inside = len(report.in_plan)
    text = (
        f"rank {rank}/{size} {args.step} width {args.width} batch {args.batch}: buckets started "
        f"inside the call {inside} of {len(report.buckets)}; printed per-rank peak "
        f"{peak.peak_bytes:,} B ({peak.peak_phase.name}), held between calls "
        f"{peak.between.nbytes:,} B, predicted growth {peak.growth_bytes:,} B; measured "
        f"growth (VmHWM - VmRSS) {', '.join(f'{g:,}' for g in growth)} B: "
        f"{np.median(growth) / peak.growth_bytes:.4f}x"
    )
    if counted[0] is not None:
        text += f"; checked mode counted {counted[-1]:,} B against {peak.counted_bytes:,} B"
    for r in range(size):
        bpd.init().comm.Barrier()
        if r == rank:
            print(text, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
