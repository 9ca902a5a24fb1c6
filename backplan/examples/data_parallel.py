"""Train the demo MLP data-parallel over MPI: every rank takes its shard of the same batch, and the
averaged gradients equal those of the whole batch, so the losses follow the single-process run.

    mpiexec -n 2 python -m backplan.examples.data_parallel --compare

--compare makes rank 0 train the same model again alone, on whole batches, and print how far the
two loss curves are apart (f32 rounding of the sum order: about 1e-7).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import backplan as bp
import backplan.distributed as bpd
from backplan.examples.mlp import init_mlp, mlp_loss, synthetic_classification

SIZES = [32, 64, 64, 10]


def train(step, rank: int, size: int, steps: int, batch: int = 64, lr: float = 0.1) -> list:
    """SGD on the synthetic task; every rank draws the same batch and keeps its shard of it."""
    x_all, y_all = synthetic_classification(4096, 32, 10)
    params = bpd.broadcast(init_mlp(SIZES, seed=0)) if size > 1 else init_mlp(SIZES, seed=0)
    rng = np.random.default_rng(1)
    losses = []
    for _ in range(steps):
        idx = rng.integers(0, len(x_all), batch)
        x = bp.tensor(bpd.shard(x_all[idx], rank, size))
        y = bp.tensor(bpd.shard(y_all[idx], rank, size))
        loss, grads = step(params, x, y)
        params = {
            k: bp.tensor(p.numpy() - lr * grads[k].numpy(), requires_grad=True)
            for k, p in params.items()
        }
        losses.append(loss.item())
    return losses


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--compare", action="store_true", help="rank 0 reruns alone and compares")
    parser.add_argument("--explain", action="store_true", help="print the bucket schedule")
    parser.add_argument("--split-plan", action="store_true", help="overlap buckets with compute")
    args = parser.parse_args(argv)
    rank, size = bpd.init()
    vg = bp.value_and_grad(mlp_loss)
    step = bpd.data_parallel(vg, split_plan=args.split_plan)
    start = time.perf_counter()
    losses = train(step, rank, size, args.steps)
    elapsed = time.perf_counter() - start
    if rank != 0:
        return 0
    for i in range(0, args.steps, 25):
        print(f"step {i:4d}  loss {losses[i]:.4f}")
    print(f"{args.steps} steps on {size} rank(s) in {elapsed:.2f} s; final loss {losses[-1]:.4f}")
    if args.explain:
        x, y = synthetic_classification(64 // size, 32, 10)
        print(step.explain(init_mlp(SIZES), bp.tensor(x), bp.tensor(y)))
    if args.compare:
        alone = train(vg, 0, 1, args.steps)
        gap = float(np.max(np.abs(np.array(alone) - np.array(losses))))
        print(f"single-process run: final loss {alone[-1]:.4f}; largest loss gap {gap:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
