"""Weights between PyTorch and backplan: the module's state_dict as backplan tensors (sharing
memory through DLPack where it can) and back as torch tensors load_state_dict accepts."""

from __future__ import annotations

import numpy as np
import torch

from backplan.tracer.dlpack import from_dlpack
from backplan.tracer.tensor import Tensor

from .dtypes import to_dtype
from .errors import TorchImportError


def parameters(module: torch.nn.Module) -> dict[str, Tensor]:
    """{state_dict name: tensor}. A parameter's tensor shares its memory (DLPack, no copy), so a
    torch optimizer stepping the module changes it; none requires grad (bp.value_and_grad
    differentiates without; set `.requires_grad = True` for eager `.backward()`).
    Buffers are copied: a torch forward in training mode changes batch norm's statistics in
    place, which would change backplan's values behind the graph's back."""
    parameter_names = {name for name, _ in module.named_parameters()}
    out = {}
    for name, value in module.state_dict(keep_vars=True).items():
        value = value.detach()
        dtype = to_dtype(value.dtype)  # refuses dtypes backplan lacks, by name
        if value.dtype == torch.bfloat16:  # NumPy reads no bfloat16 through DLPack: its bits
            tensor = Tensor(value.contiguous().view(torch.int16).numpy().view(dtype))
        elif name in parameter_names and value.is_contiguous():
            tensor = from_dlpack(value)
        else:
            tensor = Tensor(value.numpy())
        out[name] = tensor
    return out


def to_state_dict(params) -> dict[str, torch.Tensor]:
    """{name: torch tensor} for `module.load_state_dict`: copies, so a torch optimizer that
    changes them in place never writes into backplan's immutable buffers."""
    if not isinstance(params, dict) or not all(isinstance(k, str) for k in params):
        raise TorchImportError(
            "to_state_dict: params must be the flat {state_dict name: tensor} dict from_torch "
            f"returned, got {type(params).__name__}"
        )
    out = {}
    for name, value in params.items():
        if not isinstance(value, Tensor | np.ndarray):
            raise TorchImportError(f"to_state_dict: {name} is a {type(value).__name__}")
        array = value.numpy() if isinstance(value, Tensor) else value
        out[name] = torch.from_numpy(np.array(array))
    return out


def check_params(params, expected: dict[str, tuple], owner: str) -> None:
    """Missing and extra keys, and shapes, named before anything runs."""
    if not isinstance(params, dict):
        raise TorchImportError(
            f"{owner}: the first argument must be the params dict from_torch returned, got "
            f"{type(params).__name__}"
        )
    missing = sorted(set(expected) - set(params))
    extra = sorted(set(params) - set(expected))
    if missing or extra:
        raise TorchImportError(
            f"{owner}: params do not match the module's state_dict: missing "
            f"{missing or 'none'}, unexpected {extra or 'none'}"
        )
    for name, (shape, dtype) in expected.items():
        value = params[name]
        got = (tuple(getattr(value, "shape", ())), np.dtype(getattr(value, "dtype", None)))
        if got != (shape, dtype):
            raise TorchImportError(
                f"{owner}: params[{name!r}] is {got[1]}{list(got[0])}, the module's is "
                f"{dtype}{list(shape)}"
            )
