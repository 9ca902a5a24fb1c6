"""Checking a peer's step against the float64 reference, so a fast wrong answer shows."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .peers import StepOutput

# Errors are relative to the largest reference entry of each array; a leaf whose reference is
# near zero (the gradient of the attention key bias is exactly zero) is measured against this
# fraction of the largest gradient entry of the whole model instead.
LEAF_FLOOR = 1e-3
TOLERANCE = {"float32": 1e-3, "float64": 1e-8}


@dataclass
class Check:
    """Worst relative errors of the value (loss or logits) and of any gradient."""

    value_error: float
    grad_error: float
    worst_grad: str | None
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.value_error <= self.tolerance and self.grad_error <= self.tolerance

    def to_dict(self) -> dict:
        return {
            "value_rel_error": self.value_error,
            "grad_rel_error": self.grad_error,
            "worst_grad": self.worst_grad,
            "tolerance": self.tolerance,
            "ok": self.ok,
        }


def relative_error(result: np.ndarray, reference: np.ndarray, floor: float = 0.0) -> float:
    if result.shape != reference.shape:
        return float("inf")
    scale = max(float(np.max(np.abs(reference), initial=0.0)), floor, np.finfo(np.float64).tiny)
    error = float(np.max(np.abs(result - reference), initial=0.0)) / scale
    return error if np.isfinite(error) else float("inf")


def check_output(output: StepOutput, reference: StepOutput, dtype: str) -> Check:
    value_error = relative_error(output.value, reference.value)
    largest = max(
        (float(np.max(np.abs(g), initial=0.0)) for g in reference.grads.values()), default=0.0
    )
    grad_error, worst = 0.0, None
    for name, ref in reference.grads.items():
        got = output.grads.get(name)
        error = float("inf") if got is None else relative_error(got, ref, LEAF_FLOOR * largest)
        if error > grad_error or worst is None:
            grad_error, worst = error, name
    return Check(value_error, grad_error, worst, TOLERANCE[dtype])
