"""scaled_dot_product_attention with PyTorch's layout and argument names: one fused op whose
backward recomputes the probabilities instead of saving a (T, S) matrix per head."""

from __future__ import annotations

from backplan.ir.errors import DtypeError, ShapeError
from backplan.ir.ops.attention import default_scale
from backplan.ir.types import is_float

from .dispatch import apply
from .ops import as_tensor, matmul, softmax, swapaxes
from .source import located
from .tensor import Tensor, TensorLike


@located
def scaled_dot_product_attention(
    query: TensorLike,
    key: TensorLike,
    value: TensorLike,
    attn_mask=None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | Tensor | None = None,
) -> Tensor:
    """softmax(query @ key^T * scale) @ value over the last two axes, as
    torch.nn.functional.scaled_dot_product_attention: query (..., T, D), key (..., S, D),
    value (..., S, Dv), leading axes shared; scale defaults to 1 / sqrt(D); is_causal lets
    query i see keys 0..i. Writing the softmax form by hand gives the same fused kernel in
    compiled plans; only this call fuses it in eager mode too."""
    if attn_mask is not None:
        raise ShapeError(
            "scaled_dot_product_attention: attn_mask is not fused; add the mask to the scores "
            "yourself: softmax(q @ k.swapaxes(-1, -2) * scale + mask) @ v"
        )
    if dropout_p != 0.0:
        raise ShapeError(
            f"scaled_dot_product_attention: dropout_p={dropout_p!r} is not supported; apply "
            "dropout to the probabilities of the unfused form with bp.random"
        )
    if not isinstance(is_causal, bool):
        raise TypeError(
            f"scaled_dot_product_attention: is_causal must be a bool, got {is_causal!r}"
        )
    q, k, v = _same_float_dtype(query, key, value)
    if scale is None:
        scale = default_scale(q.shape[-1] if q.ndim else 0)
    if isinstance(scale, Tensor):  # a traced float: the composite, which takes a tensor scale
        if is_causal:
            raise ShapeError(
                "scaled_dot_product_attention: a traced scale with is_causal is not supported; "
                "pass scale as a Python float"
            )
        return matmul(softmax(matmul(q, swapaxes(k, -1, -2)) * scale, axis=-1), v)
    if isinstance(scale, bool) or not isinstance(scale, int | float):
        raise TypeError(f"scaled_dot_product_attention: scale must be a number, got {scale!r}")
    try:
        return apply("attention", [q, k, v], scale=float(scale), causal=is_causal)
    except ShapeError as exc:  # the fused op's message, under the name the user called
        raise ShapeError(f"scaled_dot_product_attention: {exc}") from None


def _same_float_dtype(query, key, value) -> tuple[Tensor, Tensor, Tensor]:
    """As PyTorch: query, key and value share one float dtype; nothing is cast behind the
    caller's back (an f64 key would silently lose precision in an f32 attention)."""
    q, k, v = (as_tensor(x) for x in (query, key, value))
    dtypes = [x.dtype for x in (q, k, v)]
    if len(set(dtypes)) != 1 or not is_float(q._ir_dtype):  # bfloat16's NumPy kind is "V"
        raise DtypeError(
            "scaled_dot_product_attention: query, key and value need one float dtype, got "
            f"{', '.join(str(d) for d in dtypes)}; cast them with .astype(...) first"
        )
    return q, k, v
