"""Shape and dtype rules shared by several ops."""

from ..errors import DtypeError
from ..shapes import broadcast_shapes
from ..types import TensorType, is_float


def same_dtype(types, op: str) -> str:
    dtypes = {t.dtype for t in types}
    if len(dtypes) != 1:
        raise DtypeError(f"operands have different dtypes {sorted(dtypes)}; cast one with astype")
    return dtypes.pop()


def elementwise_type(types, op: str, out_dtype: str | None = None) -> TensorType:
    dtype = same_dtype(types, op)
    return TensorType(out_dtype or dtype, broadcast_shapes(*[t.shape for t in types]))


def float_only(types, op: str) -> None:
    for t in types:
        if not is_float(t.dtype):
            raise DtypeError(f"needs a float tensor, got {t.dtype}")


def numeric_only(types, op: str) -> None:
    for t in types:
        if t.dtype == "bool":
            raise DtypeError("does not accept bool tensors; cast with astype first")
