"""Dtypes and tensor types of IR values: a small closed set, printed as bool, u8, i32, i64, bf16,
f16, f32, f64. Anything else is refused with a DtypeError naming the supported set, never
converted. bf16 is ml_dtypes.bfloat16 (the NumPy dtype JAX uses); bf16 and f16 are storage
dtypes: every op on them computes in float32 and rounds its result once (ir/widen.py)."""

import functools
from dataclasses import dataclass

import numpy as np

from .errors import DtypeError

try:
    import ml_dtypes

    BFLOAT16: np.dtype | None = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # a dependency; without it bfloat16 is refused with the install line
    BFLOAT16 = None

DTYPES = {
    "bool": np.dtype(np.bool_),
    "u8": np.dtype(np.uint8),
    "i32": np.dtype(np.int32),
    "i64": np.dtype(np.int64),
    "f16": np.dtype(np.float16),
    "f32": np.dtype(np.float32),
    "f64": np.dtype(np.float64),
}
if BFLOAT16 is not None:
    DTYPES["bf16"] = BFLOAT16
FLOAT_DTYPES = ("bf16", "f16", "f32", "f64")
HALF_DTYPES = ("bf16", "f16")  # stored in 16 bits, computed in float32
INT_DTYPES = ("u8", "i32", "i64")
_NAME_OF = {v: k for k, v in DTYPES.items()}
SUPPORTED_TEXT = "bool, uint8, int32, int64, bfloat16, float16, float32, float64"


def dtype_name(dtype) -> str:
    """Map anything numpy accepts as a dtype (or an IR name) to an IR dtype name. A dtype
    outside the supported set raises, saying which cast keeps the values."""
    if isinstance(dtype, str) and dtype in DTYPES:
        return dtype
    if BFLOAT16 is None and (dtype == "bf16" or str(dtype) == "bfloat16"):
        raise DtypeError("bfloat16 needs the ml_dtypes package: pip install ml_dtypes")
    try:
        np_dtype = np.dtype(dtype)
    except TypeError as exc:
        raise DtypeError(f"unknown dtype {dtype!r}; supported: {SUPPORTED_TEXT}") from exc
    if np_dtype not in _NAME_OF:
        raise DtypeError(
            f"dtype {np_dtype} is not supported (supported: {SUPPORTED_TEXT}); "
            f"{_suggestion(np_dtype)}"
        )
    return _NAME_OF[np_dtype]


def _suggestion(dtype: np.dtype) -> str:
    """The explicit conversion that keeps the values, or why there is none."""
    if dtype.kind == "f":
        return "convert with .astype(np.float32) (or np.float64) first"
    if dtype.kind in "iu":
        return "convert with .astype(np.int64) first (values must fit)"
    if dtype.kind == "c":
        return "complex numbers are not supported; pass .real and .imag as two float tensors"
    if dtype.kind in "mM":
        return "convert datetimes to numbers first, e.g. .astype(np.int64) for ticks"
    if dtype.fields is not None:
        return "pass each field of a structured array as its own tensor"
    return "convert the data to a numeric NumPy array first"


def np_dtype(name: str) -> np.dtype:
    return DTYPES[name]


def is_float(name: str) -> bool:
    return name in FLOAT_DTYPES


def is_int(name: str) -> bool:
    return name in INT_DTYPES


def is_half(name: str) -> bool:
    """bf16 or f16: stored in 16 bits, computed in float32."""
    return name in HALF_DTYPES


def compute_dtype(name: str) -> str:
    """The dtype an op computes in: float32 for the 16-bit floats, the dtype itself otherwise."""
    return "f32" if name in HALF_DTYPES else name


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

    @functools.cached_property
    def nbytes(self) -> int:
        """Worked out once per type: values share their types (a plan's copies keep them), and
        the memory planner asks every buffer's bytes of every plan it weighs."""
        return self.size * DTYPES[self.dtype].itemsize

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(str(d) for d in self.shape)}]"


_CATEGORY = {"bool": 0, "u8": 1, "i32": 1, "i64": 1, "bf16": 2, "f16": 2, "f32": 2, "f64": 2}
_FLOAT_RANK = {"bf16": 0, "f16": 0, "f32": 1, "f64": 2}


def promote_types(a: str, b: str) -> str:
    """Promotion between two tensor dtypes, as PyTorch and JAX do it: within a category (bool,
    integer, float) the wider wins as in NumPy; across categories the higher category's dtype
    wins, so int64 @ float32 is float32 (NumPy would give float64) and int32 with bfloat16 is
    bfloat16. bfloat16 with float16 is float32 (neither holds the other's values), as in JAX."""
    if _CATEGORY[a] != _CATEGORY[b]:
        return a if _CATEGORY[a] > _CATEGORY[b] else b
    if _CATEGORY[a] == 2:
        if a == b:
            return a
        if {a, b} == {"bf16", "f16"}:
            return "f32"
        return a if _FLOAT_RANK[a] > _FLOAT_RANK[b] else b
    return dtype_name(np.promote_types(DTYPES[a], DTYPES[b]))


def promote_with_scalar(tensor_dtype: str, scalar) -> str:
    """NumPy 2 rule for Python scalars: they are weak and never widen a tensor of their own
    category; an int that does not fit an integer tensor's dtype raises, as in NumPy 2."""
    if isinstance(scalar, bool):
        return tensor_dtype
    if isinstance(scalar, int):
        if tensor_dtype == "bool":
            return "i64"
        if is_int(tensor_dtype):
            info = np.iinfo(DTYPES[tensor_dtype])
            if not info.min <= scalar <= info.max:
                raise DtypeError(
                    f"Python int {scalar} does not fit a {DTYPES[tensor_dtype]} tensor "
                    f"({info.min}..{info.max}); cast the tensor with .astype('int64') first"
                )
        return tensor_dtype
    if isinstance(scalar, float):
        return tensor_dtype if is_float(tensor_dtype) else "f64"
    raise DtypeError(f"unsupported scalar {scalar!r} of type {type(scalar).__name__}")
