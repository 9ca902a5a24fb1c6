"""`python -m backplan demo`: show the backward plan of a small MLP, then train it with a
compiled step that does forward, backward and an Adam update in one call."""

from __future__ import annotations

import sys
import time

import numpy as np

import backplan as bp
from backplan.examples.mlp import init_mlp, make_train_step, mlp_loss, synthetic_classification

SIZES = [32, 64, 64, 10]


def add_arguments(parser) -> None:
    parser.add_argument("--steps", type=int, default=200, help="training steps")


def run(args) -> int:
    train(steps=args.steps)
    return 0


def show_backward_plan(x, labels, out) -> None:
    """One loss.backward() the PyTorch way: the plan is known before backward runs."""
    params = init_mlp(SIZES)
    loss = mlp_loss(params, bp.tensor(x), bp.tensor(labels))
    print("\nThe backward plan of one step, before backward runs:", file=out)
    print(loss.grad_fn, file=out)
    allocated, yours = bp.live_saved_bytes(), bp.live_saved_bytes(yours=True)
    print(
        f"live saved bytes: {allocated} allocated by the graph, and {yours} of your own arrays it"
        f" holds by reference (* above): {allocated + yours} B held",
        file=out,
    )
    loss.backward()
    print(f"after backward:   {bp.live_saved_bytes()} (every saved buffer freed)\n", file=out)


def train(steps: int = 200, batch: int = 64, lr: float = 3e-3, out=sys.stdout) -> list[float]:
    x_all, y_all = synthetic_classification(4096, 32, 10)
    print("Training a 32-64-64-10 MLP on synthetic data with @bp.compile", file=out)
    show_backward_plan(x_all[:batch], y_all[:batch], out)
    optimizer = bp.optim.adam(bp.optim.cosine_decay(lr, decay_steps=steps, alpha=0.1))
    train_step = make_train_step(optimizer)
    params = init_mlp(SIZES, requires_grad=False)
    state = optimizer.init(params)
    print(
        "Training with bp.optim.adam and a cosine schedule: one compiled call per step does the "
        "forward, the backward and the update, writing into the donated parameter buffers.",
        file=out,
    )
    losses, start = [], time.perf_counter()
    rng = np.random.default_rng(1)
    for step in range(steps):
        idx = rng.integers(0, len(x_all), batch)
        params, state, loss = train_step(params, state, x_all[idx], y_all[idx])
        losses.append(loss.item())
        if step == 0:
            first_call, start = time.perf_counter() - start, time.perf_counter()
        if step % 25 == 0 or step == steps - 1:
            recent = losses[-25:]
            print(
                f"step {step:4d}  loss {losses[-1]:.4f}  (mean of the last {len(recent):2d} "
                f"steps {np.mean(recent):.4f})",
                file=out,
            )
    elapsed = time.perf_counter() - start
    info = train_step.cache_info()
    print(
        f"\nfirst call (trace, plan, compile or load the kernels) {first_call:.2f} s; "
        f"the other {steps - 1} steps {elapsed:.2f} s ({1e3 * elapsed / max(steps - 1, 1):.2f} ms "
        f"each); traced {info.traces} time(s), {info.hits} cache hits",
        file=out,
    )
    first, last = np.mean(losses[:10]), np.mean(losses[-10:])
    print(f"mean loss of the first 10 steps {first:.3f}, of the last 10 {last:.3f}", file=out)
    return losses
