"""What every peer provides: a way to build a runner for one model, and the facts it can
report about that runner (saved-for-backward bytes, planned peak)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from ..models import ModelInputs, ModelSpec


@dataclass
class StepOutput:
    """The result of one step as float64 NumPy: the loss (or the logits of a forward-only
    model) and the gradients by parameter name (empty when forward only)."""

    value: np.ndarray
    grads: dict[str, np.ndarray]


@dataclass
class SavedBytes:
    """Bytes kept from forward for backward: all of them, and those that are not inputs."""

    excluding_inputs: int
    including_inputs: int
    source: str


class Runner(ABC):
    """One model built by one peer. step() runs forward and backward to completion."""

    # True when the step allocates through NumPy, so tracemalloc sees its memory.
    numpy_allocations = False

    @abstractmethod
    def step(self) -> None: ...

    @abstractmethod
    def output(self) -> StepOutput:
        """The output of the latest step."""

    def saved_bytes(self) -> SavedBytes | None:
        return None

    def planned_peak_bytes(self) -> tuple[int, str] | None:
        """(bytes, what planned them) where a compiler states its plan's peak."""
        return None

    def counted_peak_bytes(self) -> dict | None:
        """The step's peak counted buffer by buffer by the compiler's own checked mode:
        {"bytes": comparable with planned_peak_bytes, "counted", "predicted"}, or None."""
        return None

    def plan_facts(self) -> dict | None:
        """Anything else the compiler states about its plan (backend, kernel counts)."""
        return None

    def first_call_parts(self) -> dict[str, float]:
        """Named parts of the cold first call in seconds (an import before the first step)."""
        return {}


class Peer(ABC):
    """A framework the benchmark runs models through."""

    name = ""
    family = ""  # what --against selects: "backplan", "numpy", "torch", "jax"
    description = ""
    # What the warm first call measures for this peer (see Peer.clear_caches).
    warm_first_call = "a new runner's first call; nothing to compile"

    def missing(self) -> str | None:
        """Why this peer cannot run here (not installed), or None."""
        return None

    def versions(self) -> dict[str, str]:
        return {}

    def skip_reason(self, spec: ModelSpec) -> str | None:
        """Why this peer does not run this model, or None."""
        return None

    def clear_caches(self) -> None:  # noqa: B027 - most peers have no compile cache
        """Drop in-process compile caches, so the next build compiles again (warm compile)."""

    @abstractmethod
    def build(self, spec: ModelSpec, inputs: ModelInputs) -> Runner:
        """A fresh runner (no step run yet); inputs are already in the benchmark dtype."""


def as_float64(array) -> np.ndarray:
    return np.asarray(array, dtype=np.float64)
