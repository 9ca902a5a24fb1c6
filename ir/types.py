"""Dtypes and tensor types of IR values: a small closed set, printed as f32, f64, i64, bool."""

from dataclasses import dataclass

import numpy as np

from .errors import DtypeError

DTYPES = {
    "bool": np.dtype(np.bool_),
    "i64": np.dtype(np.int64),
    "f32": np.dtype(np.float32),
    "f64": np.dtype(np.float64),
}
FLOAT_DTYPES = ("f32", "f64")
_NAME_OF = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype) -> str:
    """Map anything numpy accepts as a dtype (or an IR name) to an IR dtype name."""
    if isinstance(dtype, str) and dtype in DTYPES:
        return dtype
    try:
        np_dtype = np.dtype(dtype)
    except TypeError as exc:
        raise DtypeError(f"unknown dtype {dtype!r}") from exc
    if np_dtype.kind in "iu" and np_dtype != np.int64:
        return "i64"
    if np_dtype not in _NAME_OF:
        supported = ", ".join(str(d) for d in DTYPES.values())
        raise DtypeError(f"dtype {np_dtype} is not supported; use one of {supported}")
    return _NAME_OF[np_dtype]


def np_dtype(name: str) -> np.dtype:
    return DTYPES[name]


def is_float(name: str) -> bool:
    return name in FLOAT_DTYPES


@dataclass(frozen=True)
class TensorType:
    dtype: str
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.size * DTYPES[self.dtype].itemsize

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(str(d) for d in self.shape)}]"


def promote_types(a: str, b: str) -> str:
    """NumPy 2 promotion between two tensor dtypes."""
    return dtype_name(np.promote_types(DTYPES[a], DTYPES[b]))


def promote_with_scalar(tensor_dtype: str, scalar) -> str:
    """NumPy 2 rule for Python scalars: they are weak and never widen a float tensor."""
    if isinstance(scalar, bool):
        return tensor_dtype
    if isinstance(scalar, int):
        return "i64" if tensor_dtype == "bool" else tensor_dtype
    if isinstance(scalar, float):
        return tensor_dtype if is_float(tensor_dtype) else "f64"
    raise DtypeError(f"unsupported scalar {scalar!r} of type {type(scalar).__name__}")
