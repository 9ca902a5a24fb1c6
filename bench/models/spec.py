"""What a benchmark model is: its sizes, its inputs and which implementation each peer uses."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np


@dataclass
class ModelInputs:
    """One model's data. params are differentiated; inputs feed the forward; targets only the
    loss. Float arrays are float64 here and cast to the benchmark dtype by `cast`."""

    params: dict[str, np.ndarray]
    inputs: tuple[np.ndarray, ...]
    targets: tuple[np.ndarray, ...] = ()

    def cast(self, dtype) -> ModelInputs:
        return ModelInputs(
            {name: _cast(a, dtype) for name, a in self.params.items()},
            tuple(_cast(a, dtype) for a in self.inputs),
            tuple(_cast(a, dtype) for a in self.targets),
        )

    def batch(self, train: bool) -> tuple[np.ndarray, ...]:
        """What follows the params in a call: inputs and targets for a loss, inputs alone for
        a forward-only model."""
        return (*self.inputs, *self.targets) if train else self.inputs

    @property
    def nbytes(self) -> int:
        arrays = [*self.params.values(), *self.inputs, *self.targets]
        return sum(a.nbytes for a in arrays)


def _cast(array: np.ndarray, dtype) -> np.ndarray:
    if np.issubdtype(array.dtype, np.floating):
        return np.ascontiguousarray(array, dtype=dtype)
    return array


@dataclass(frozen=True)
class ModelSpec:
    """A benchmark model. `kind` names the implementation every peer provides ("mlp",
    "transformer", "ln_gelu"); `static` holds the keyword arguments of that implementation
    (activation, heads); `config` the full sizes and `small_config` the shrunk ones."""

    name: str
    kind: str
    summary: str
    config: dict
    small_config: dict
    make_inputs: Callable[[dict, int], ModelInputs]
    static: dict = field(default_factory=dict)
    train: bool = True

    def sizes(self, small: bool) -> dict:
        return self.small_config if small else self.config

    def inputs(self, small: bool, dtype, seed: int = 0) -> ModelInputs:
        return self.make_inputs(self.sizes(small), seed).cast(dtype)
