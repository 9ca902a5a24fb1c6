"""A small typed program over backplan's public API; tests/test_packaging.py runs mypy on it."""

from __future__ import annotations

import dataclasses

import numpy as np

import backplan as bp


@dataclasses.dataclass(frozen=True)
class Params:
    w: bp.Tensor
    b: bp.Tensor


@bp.compile
def loss_fn(params: Params, x: bp.Tensor, labels: bp.Tensor) -> bp.Tensor:
    logits = bp.tanh(x @ params.w + params.b)
    return bp.cross_entropy(logits, labels) + 0.01 * (params.w * params.w).sum()


def train_step(params: Params, x: np.ndarray, labels: np.ndarray) -> tuple[float, Params]:
    step = bp.value_and_grad(loss_fn)
    loss, grads = step(params, bp.tensor(x), bp.tensor(labels))
    new: Params = bp.tree.map(lambda p, g: (p - 0.1 * g).detach(), params, grads)
    return loss.item(), new


def shapes(t: bp.Tensor) -> tuple[int, ...]:
    moved: bp.Tensor = t.reshape(-1).astype("float64").T.sum(axis=0, keepdims=True)
    leaves: list[object] = bp.tree.leaves({"t": t})
    view: np.ndarray = moved.numpy()
    shared: bp.Tensor = bp.from_dlpack(view)
    return shared.shape + (len(leaves),)


@bp.compile(background=True)
def scaled(x: bp.Tensor) -> bp.Tensor:
    return x * 2.0


def compiled_yet(timeout: float) -> tuple[str | None, bool]:
    step = bp.value_and_grad(scaled, background=False)
    return scaled.driver_tier, step.wait_until_compiled(timeout=timeout)
