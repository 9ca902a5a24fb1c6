"""A float64 operand silently turning a float32 graph into float64, said once per line.

NumPy 2 promotes `float32 * np.float64` to float64 (a NumPy float64 scalar is not a weak Python
float): `x @ (w * (1 / np.sqrt(d)))` with float32 arrays traces a float64 matmul, and every
value computed from it is float64, twice the bytes and on most CPUs half the speed, with no
error. PyTorch refuses such a mixed matmul; backplan computes what NumPy would and warns once
per user line (in a trace, its first such op only: the later ones mostly follow from it), naming
the op and both dtypes (tracer/ops.py's operand promotion asks)."""

from __future__ import annotations

import threading
import warnings

from .source import loc_text, user_frame_loc
from .trace import current_trace

NARROW = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}  # IR name -> NumPy's
_warned: set = set()
_lock = threading.Lock()


class Float64PromotionWarning(UserWarning):
    """A float64 operand promoted a narrower float graph to float64 (filter by this class)."""


def check_promotion(op: str, a, b, dtype: str) -> None:
    """Warn once per (op, line) when float64 operand `a` or `b` makes the op compute in
    float64 where the other is a narrower float (both strong: Python floats never promote)."""
    if dtype != "f64":
        return
    kinds = (a._ir_dtype, b._ir_dtype)
    if "f64" not in kinds or not any(k in NARROW for k in kinds):
        return
    narrow, wide = (a, b) if a._ir_dtype in NARROW else (b, a)
    loc = user_frame_loc()
    trace = current_trace()
    key = (op, loc)
    with _lock:
        if trace is not None:  # a trace's first only: its later mixed ops mostly follow from it
            if getattr(trace, "promotion_warned", False):
                return
            trace.promotion_warned = True
        if key in _warned:
            return
        _warned.add(key)
    kind = NARROW[narrow._ir_dtype]
    message = (
        f"{op} at {loc_text(loc)}: a {kind} operand {list(narrow.shape)} meets a "
        f"float64 one {list(wide.shape)}, so this result and everything computed from it is "
        "float64 (NumPy's promotion; a NumPy float64 scalar such as 1 / np.sqrt(n) is not a "
        f"weak Python float). Cast it to stay in {kind}: np.float32(...), "
        ".astype(np.float32) or float(...)"
    )
    if loc is None:
        warnings.warn(message, Float64PromotionWarning, stacklevel=4)
    else:
        warnings.warn_explicit(message, Float64PromotionWarning, loc[0], loc[1])
