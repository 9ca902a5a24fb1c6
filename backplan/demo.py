"""`python -m backplan demo`: train a small MLP with @compile and show its backward plan."""

from __future__ import annotations

import sys
import time

import numpy as np

import backplan as bp
from backplan.examples.mlp import init_mlp, mlp_loss, synthetic_classification


def sgd_step(params: dict, lr: float) -> None:
    for name, p in params.items():
        params[name] = bp.tensor(p.numpy() - lr * p.grad.numpy(), requires_grad=True)


def add_arguments(parser) -> None:
    parser.add_argument("--steps", type=int, default=200, help="training steps")


def run(args) -> int:
    train(steps=args.steps)
    return 0


def train(steps: int = 200, batch: int = 64, lr: float = 0.1, out=sys.stdout) -> list[float]:
    x_all, y_all = synthetic_classification(4096, 32, 10)
    params = init_mlp([32, 64, 64, 10])
    print("Training a 32-64-64-10 MLP on synthetic data with @bp.compile", file=out)
    losses, start = [], time.perf_counter()
    rng = np.random.default_rng(1)
    for step in range(steps):
        idx = rng.integers(0, len(x_all), batch)
        loss = mlp_loss(params, bp.tensor(x_all[idx]), bp.tensor(y_all[idx]))
        if step == 0:
            print("\nThe backward plan of one step, before backward runs:", file=out)
            print(loss.grad_fn, file=out)
            print(f"live saved bytes: {bp.live_saved_bytes()}", file=out)
        loss.backward()
        if step == 0:
            print(
                f"after backward:   {bp.live_saved_bytes()} (every saved buffer freed)\n", file=out
            )
        losses.append(loss.item())
        sgd_step(params, lr)
        if step % 25 == 0 or step == steps - 1:
            recent = np.mean(losses[-25:])
            print(f"step {step:4d}  loss {recent:.4f}", file=out)
    elapsed = time.perf_counter() - start
    info = mlp_loss.cache_info()
    print(
        f"\n{steps} steps in {elapsed:.2f} s; traced {info.traces} time(s), {info.hits} cache hits",
        file=out,
    )
    print(f"loss fell from {np.mean(losses[:10]):.3f} to {np.mean(losses[-10:]):.3f}", file=out)
    return losses
