"""Step time of data-parallel training on the bench mlp (784-512-512-10, global batch 128, f32):
N ranks each on 128/N rows against one rank on all 128. A measurement, not a test; run it as

    OPENBLAS_NUM_THREADS=1 NUMBA_NUM_THREADS=1 python -m backplan.bench.data_parallel
    OPENBLAS_NUM_THREADS=1 NUMBA_NUM_THREADS=1 mpiexec -n 2 python -m backplan.bench.data_parallel

Rank 0 prints the median step time, the median time of the same rank's local value_and_grad
alone (compute) and their difference: the exchange as the step sees it (packing, the
allreduces, waiting for the slower rank), less what --split-plan hides behind compute, plus
what cutting the plan costs.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import backplan as bp
import backplan.distributed as bpd
from backplan.bench.models import mlp

CONFIG = dict(n_in=784, width=512, depth=2, n_out=10, batch=128)


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="data-parallel step time on the bench mlp")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--bucket-bytes", type=int, default=bpd.DEFAULT_BUCKET_BYTES)
    parser.add_argument("--split-plan", action="store_true", help="cut the plan at buckets")
    args = parser.parse_args(argv)
    rank, size = bpd.init()
    data = mlp.make_inputs(CONFIG, seed=0).cast(np.float32)
    params = {k: bp.tensor(v, requires_grad=True) for k, v in data.params.items()}
    x = bp.tensor(bpd.shard(data.inputs[0], rank, size))
    labels = bp.tensor(bpd.shard(data.targets[0], rank, size))
    vg = bp.value_and_grad(mlp.loss)
    step = bpd.data_parallel(vg, bucket_bytes=args.bucket_bytes, split_plan=args.split_plan)
    for _ in range(5):
        step(params, x, labels)  # compiles, warms caches
    bpd.check_replicas(params)
    step_s = median_seconds(lambda: step(params, x, labels), args.repeats)
    compute_s = median_seconds(lambda: vg(params, x, labels), args.repeats)
    if rank == 0:
        report = step.explain(params, x, labels)
        exposed_s = max(step_s - compute_s, 0.0)
        print(
            f"ranks {size}  rows/rank {x.shape[0]}  buckets {len(report.buckets)}  "
            f"bytes/step {report.bytes_per_step:,}  split_plan {args.split_plan}\n"
            f"step {step_s * 1e3:.2f} ms  compute alone {compute_s * 1e3:.2f} ms  "
            f"step - compute {exposed_s * 1e3:.2f} ms"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
