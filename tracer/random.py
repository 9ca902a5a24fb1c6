"""bp.random: keys are i64[2] tensors passed to compiled functions as arguments, so each call can
draw new numbers without retracing, and a draw is a pure function of its key (threefry-2x32):
the same key gives the same bits eagerly, compiled, and when backward recomputes a mask.

>>> import backplan as bp
>>> key = bp.random.key(0)
>>> k1, k2 = bp.random.split(key)
>>> bp.random.normal(k1, (2, 3)).shape
(2, 3)
"""

from __future__ import annotations

import numpy as np

from backplan.ir.errors import DtypeError
from backplan.ir.types import dtype_name, is_float, is_half

from .dispatch import apply
from .ops import as_tensor, astype, full, less, minimum, mul, sub, where
from .source import loc_text, user_frame_loc
from .tensor import Tensor

MASK32 = 0xFFFFFFFF
BELOW_ONE = {"bf16": 1.0 - 2.0**-8, "f16": 1.0 - 2.0**-11}  # the largest value below 1


def _at_line(message: str) -> str:
    """The message with the user's line, as the ops' errors carry it (tracer/source.py)."""
    loc = user_frame_loc()
    return message if loc is None else f"{message} at {loc_text(loc)}"


def key(seed: int) -> Tensor:
    """A key from an integer seed: the seed's high and low 32-bit words (as jax.random.PRNGKey)."""
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
        raise TypeError(
            _at_line(
                f"bp.random.key: seed must be a Python int, got {type(seed).__name__}; inside a "
                "compiled function, take the key itself as an argument instead of a seed"
            )
        )
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    return Tensor(np.array([seed >> 32, seed & MASK32], np.int64))


def _key(k, what: str) -> Tensor:
    """k as a key, or an error naming the function given it (what) and the user's line."""
    k = as_tensor(k)
    if k._ir_dtype != "i64" or k.shape != (2,):
        raise DtypeError(
            _at_line(
                f"{what}: expected a key (an int64 tensor of shape (2,)), got {k.dtype} "
                f"{k.shape}; make one with bp.random.key(seed) and new ones with "
                "bp.random.split(key)"
            )
        )
    return k


def split(k, num: int = 2) -> tuple[Tensor, ...]:
    """`num` independent keys derived from k; never reuse k itself after splitting it."""
    if isinstance(num, bool) or not isinstance(num, int) or num < 1:
        raise ValueError(_at_line(f"bp.random.split: num must be a positive int, got {num!r}"))
    keys = apply("random_split", [_key(k, "bp.random.split")], count=num)
    return tuple(keys[i] for i in range(num))


def _float_dtype(dtype, what: str) -> str:
    name = dtype_name(dtype)
    if not is_float(name):
        raise TypeError(
            _at_line(f"bp.random.{what}: dtype must be float32 or float64, got {dtype}")
        )
    return name


def _shape(shape) -> tuple[int, ...]:
    return (shape,) if isinstance(shape, int) else tuple(shape)


def uniform(k, shape=(), dtype="float32", low=0.0, high=1.0) -> Tensor:
    """Floats in [low, high): 24 random bits per float32 value, 53 per float64 value. bfloat16
    and float16 values are the float32 draw rounded to nearest, those that would round up to
    1.0 taking the largest value below 1 instead, so [0, 1) holds (as in JAX and PyTorch)."""
    dtype = _float_dtype(dtype, "uniform")
    u = apply(
        "random_uniform",
        [_key(k, "bp.random.uniform")],
        shape=_shape(shape),
        dtype=_draw_dtype(dtype),
    )
    if is_half(dtype):
        u = minimum(astype(u, dtype), full((), BELOW_ONE[dtype], dtype))
    if isinstance(low, int | float) and isinstance(high, int | float) and (low, high) == (0, 1):
        return u
    return u * (high - low) + low


def _draw_dtype(dtype: str) -> str:
    return "f32" if is_half(dtype) else dtype


def normal(k, shape=(), dtype="float32") -> Tensor:
    """Standard normal floats (Box-Muller on threefry words, computed in float64)."""
    return apply(
        "random_normal",
        [_key(k, "bp.random.normal")],
        shape=_shape(shape),
        dtype=_float_dtype(dtype, "normal"),
    )


def bernoulli(k, p=0.5, shape=None) -> Tensor:
    """Booleans that are True with probability p (a number or a tensor broadcast to shape)."""
    if shape is None:
        shape = () if isinstance(p, int | float) else as_tensor(p).shape
    if isinstance(p, int | float) and not 0 <= p <= 1:
        raise ValueError(_at_line(f"bp.random.bernoulli: p must lie in [0, 1], got {p}"))
    # a traced Python float (weak) draws as the float itself would: the same numbers per key
    strong_f64 = isinstance(p, Tensor) and p._ir_dtype == "f64" and not p._weak
    dtype = "f64" if strong_f64 else "f32"
    return less(uniform(_key(k, "bp.random.bernoulli"), shape, dtype), p)


def dropout(x, rate, k) -> Tensor:
    """Inverted dropout: each element is zeroed with probability `rate` and the survivors are
    scaled by 1 / (1 - rate), so the expected value is unchanged; rate == 0 returns x. The mask
    is a pure function of k, so backward recomputes it bit for bit instead of saving it. For
    bfloat16 / float16 x it is drawn in float32 (the same mask as a float32 x): a 16-bit draw
    holds too few values below 1, so the rate kept would drift from `rate` (0.001 kept all).

    >>> import backplan as bp
    >>> y = bp.dropout(bp.ones((4,)), 0.5, bp.random.key(0))
    >>> sorted(set(y.numpy().tolist())) in ([0.0, 2.0], [0.0], [2.0])
    True
    """
    x = as_tensor(x)
    if not is_float(x._ir_dtype):
        raise TypeError(_at_line(f"bp.dropout: x must be a float tensor, got {x.dtype}"))
    k = _key(k, "bp.dropout")  # checked here, not by uniform: the error names bp.dropout
    draw = _draw_dtype(x._ir_dtype)  # 16-bit x: a float32 draw; bf16's would drop 0.4% more
    if isinstance(rate, Tensor):
        keep = sub(1.0, astype(rate, draw))
        u = uniform(k, x.shape, draw)
        return where(less(u, keep), astype(x / keep, x._ir_dtype), full((), 0, x._ir_dtype))
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 <= rate < 1:
        raise ValueError(
            _at_line(
                f"bp.dropout: rate must be a number in [0, 1), got {rate!r} (rate is the "
                "fraction of elements zeroed; 1 would zero everything)"
            )
        )
    if rate == 0:
        return x
    keep = 1.0 - float(rate)
    mask = less(uniform(k, x.shape, draw), keep)
    return where(mask, mul(x, 1.0 / keep), full((), 0, x._ir_dtype))
