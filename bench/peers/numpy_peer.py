"""Hand-written NumPy forward and backward: the baseline every compiler should beat, and (in
float64) the reference every peer's gradients are checked against."""

from __future__ import annotations

import numpy as np

from ..models import ModelInputs, ModelSpec
from . import numpy_cnn, numpy_ln_gelu, numpy_lstm, numpy_mlp, numpy_transformer
from .base import Peer, Runner, SavedBytes, StepOutput, as_float64

# kind -> (forward returning (loss, cache), backward(params, cache) -> grads, inference forward)
NUMPY_KINDS = {
    "mlp": (numpy_mlp.forward, numpy_mlp.backward, numpy_mlp.logits),
    "transformer": (numpy_transformer.forward, numpy_transformer.backward, None),
    "ln_gelu": (numpy_ln_gelu.forward, numpy_ln_gelu.backward, None),
    "cnn": (numpy_cnn.forward, numpy_cnn.backward, numpy_cnn.logits),
    "lstm": (numpy_lstm.forward, numpy_lstm.backward, None),
}


def run_numpy(spec: ModelSpec, inputs: ModelInputs):
    """One step: (value, grads, cache). Forward-only models give (logits, {}, {})."""
    forward, backward, infer = NUMPY_KINDS[spec.kind]
    if not spec.train:
        return infer(inputs.params, *inputs.batch(False), **spec.static), {}, {}
    value, cache = forward(inputs.params, *inputs.batch(True), **spec.static)
    return value, backward(inputs.params, cache, **spec.static), cache


def reference_output(spec: ModelSpec, inputs: ModelInputs) -> StepOutput:
    """The float64 reference: the hand-written step on the same values upcast to float64."""
    value, grads, _ = run_numpy(spec, inputs.cast(np.float64))
    return StepOutput(as_float64(value), {k: as_float64(g) for k, g in grads.items()})


class NumpyRunner(Runner):
    numpy_allocations = True

    def __init__(self, spec: ModelSpec, inputs: ModelInputs):
        self.spec, self.inputs = spec, inputs
        self.result = None

    def step(self) -> None:
        self.result = run_numpy(self.spec, self.inputs)

    def output(self) -> StepOutput:
        value, grads, _ = self.result
        return StepOutput(as_float64(value), {k: as_float64(g) for k, g in grads.items()})

    def saved_bytes(self) -> SavedBytes | None:
        if not self.spec.train:
            return None
        _, _, cache = run_numpy(self.spec, self.inputs)
        inputs = [*self.inputs.params.values(), *self.inputs.batch(True)]
        return unique_array_bytes(_arrays_in(cache), inputs, "arrays the forward keeps")


class NumpyPeer(Peer):
    name = family = "numpy"
    description = "hand-written NumPy forward and backward"

    def versions(self) -> dict[str, str]:
        return {"numpy": np.__version__}

    def build(self, spec: ModelSpec, inputs: ModelInputs) -> Runner:
        return NumpyRunner(spec, inputs)


def _arrays_in(tree) -> list[np.ndarray]:
    if isinstance(tree, np.ndarray):
        return [tree]
    if isinstance(tree, dict):
        tree = list(tree.values())
    if isinstance(tree, list | tuple):
        return [a for item in tree for a in _arrays_in(item)]
    return []


def unique_array_bytes(arrays, inputs, source: str) -> SavedBytes:
    """Bytes of the distinct buffers behind arrays (views count once), with and without the
    buffers that belong to the inputs."""

    def base(a):
        while isinstance(a.base, np.ndarray):
            a = a.base
        return a

    buffers = {id(base(a)): base(a) for a in arrays}
    input_ids = {id(base(a)) for a in inputs}
    total = sum(b.nbytes for b in buffers.values())
    own = sum(b.nbytes for key, b in buffers.items() if key not in input_ids)
    return SavedBytes(own, total, source)
