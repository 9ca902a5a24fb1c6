"""torch dtypes as backplan's. Only the ones backplan has; others are refused by name."""

from __future__ import annotations

import numpy as np

from backplan.ir.types import DTYPES

from .errors import TorchImportError

_NAMES = {
    "torch.float32": np.float32,
    "torch.float64": np.float64,
    "torch.int64": np.int64,
    "torch.int32": np.int32,
    "torch.uint8": np.uint8,
    "torch.bool": np.bool_,
    "torch.float16": np.float16,
    **({"torch.bfloat16": DTYPES["bf16"]} if "bf16" in DTYPES else {}),
}


def to_dtype(dtype, value=None):
    """The NumPy dtype for a torch dtype; with none given, torch's default for `value` (float32
    for floats, int64 for ints, bool for bools)."""
    if dtype is None:
        if isinstance(value, bool):
            return np.bool_
        return np.int64 if isinstance(value, int) else np.float32
    found = _NAMES.get(str(dtype))
    if found is None:
        raise TorchImportError(
            f"dtype {dtype} has no backplan type (backplan has {', '.join(_NAMES)}); cast the "
            "module or its inputs to float32 before importing"
        )
    return found
