"""Hyperparameters as values inside the update: the learning rate at this step, and scalars
cast to each parameter's dtype (a float64 schedule value must not widen float32 params)."""

from __future__ import annotations

import numpy as np

from backplan.tracer import ops
from backplan.tracer.tensor import Tensor


def new_count() -> Tensor:
    """The step count of a fresh state: updates done so far."""
    return ops.tensor(np.int64(0))


def learning_rate(lr, count):
    """lr itself, or the schedule's value at this count."""
    return lr(count) if callable(lr) else lr


def lr_text(lr) -> str:
    """The rate as an optimizer's name shows it: a schedule by its name (cosine_decay(0.01,
    20)), not the function's repr with its address, which errors quoted."""
    return getattr(lr, "__name__", repr(lr)) if callable(lr) else repr(lr)


def leaf_scalar(value, leaf):
    """A hyperparameter ready to meet `leaf`: Python numbers stay weak; tensors (a schedule's
    float64 value, a traced float) take the leaf's dtype."""
    if isinstance(value, Tensor):
        return ops.astype(value, leaf._ir_dtype)
    return value
