"""The training step of an imported module, for explain: the module's forward, a loss on its
output, and the gradient of every trainable parameter, as one value_and_grad function whose
arguments are named (params, buffers, inputs, target) so the plan reads `params['fc.weight']`."""

from __future__ import annotations

import inspect

import numpy as np
import torch

from backplan.ir.types import BFLOAT16
from backplan.tracer import ops
from backplan.tracer import random as bp_random
from backplan.tracer.functional import value_and_grad

from .errors import TorchImportError
from .importer import from_torch

LOSSES = ("cross_entropy", "mse", "sum")


def training_step(module: torch.nn.Module, inputs: dict, loss: str = "sum"):
    """(step, args): `bp.explain(step, *args)` prints the plan of one training step of module
    on inputs {name: array} (in forward's order) with the named loss."""
    if loss not in LOSSES:
        raise TorchImportError(f"--loss {loss!r}: choose one of {', '.join(LOSSES)}")
    _check_input_names(module, list(inputs))
    examples = tuple(_torch_array(np.array(a)) for a in inputs.values())
    fn, params = from_torch(module, examples)
    graph = fn.imported
    key = bp_random.key(0) if graph.dropouts else None
    out_shape = graph.output_shapes[0]
    target = _target(loss, out_shape)
    names = list(inputs)

    def step(params, buffers, inputs, target):
        out = fn({**params, **buffers}, *[inputs[n] for n in names], key=key)
        new_buffers = None
        if graph.mutates:
            out, new_buffers = out
        out = out if not isinstance(out, tuple | list) else out[0]
        return _loss(loss, out, target), new_buffers

    step.__name__ = step.__qualname__ = f"{graph.owner}_train_step"
    trainable = {k: params[k] for k in fn.parameter_names}
    buffers = {k: params[k] for k in fn.buffer_names}
    return value_and_grad(step, has_aux=True), (trainable, buffers, dict(inputs), target)


def _torch_array(array: np.ndarray) -> torch.Tensor:
    """A torch tensor of the array's values; torch.from_numpy takes no bfloat16 (an ml_dtypes
    array), so its bits cross as int16 and are viewed as torch.bfloat16."""
    if array.dtype == BFLOAT16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _check_input_names(module: torch.nn.Module, names: list[str]) -> None:
    """The inputs are passed to forward by position, so their names must be forward's first
    parameters in order: `--args "y: ..."` for forward(self, x) labelled x as y in the plan,
    and two inputs given in another order went to the wrong parameters."""
    try:
        signature = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = [p.name for p in signature.parameters.values() if p.kind in kinds]
    if any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in signature.parameters.values()):
        return  # forward(*args): any names
    if names != params[: len(names)]:
        owner = type(module).__name__
        raise TorchImportError(
            f"--args names {', '.join(names)}, but {owner}.forward takes "
            f"({', '.join(params)}): name the inputs as forward's parameters, in their order"
        )


def _target(loss: str, out_shape: tuple):
    if loss == "cross_entropy":
        if len(out_shape) < 1:
            raise TorchImportError("--loss cross_entropy needs an output of shape (..., classes)")
        return np.zeros(out_shape[:-1], np.int64)  # class labels, one per row
    return np.zeros(out_shape, np.float32) if loss == "mse" else None


def _loss(loss: str, out, target):
    if loss == "cross_entropy":
        return ops.cross_entropy(out, target)
    if loss == "mse":
        return ops.mse_loss(out, target)
    return ops.sum(out)
