"""Scans: cumsum along one axis, forward or from the end (its own derivative runs the other
way). The kernel sees the 3-D view (before, axis, after) and adds row after row, so the inner
loop runs along contiguous memory; each element's sum is added in the order NumPy's cumsum adds
it."""

from backplan.codegen.flags import FASTMATH
from backplan.codegen.jit import njit
from backplan.codegen.render.opaque import OpEmitter, emits
from backplan.ir.graph import Value

_opts = {"cache": True, "fastmath": FASTMATH, "error_model": "numpy", "nogil": True}


@njit(**_opts)
def cumsum_strided(x, out, reverse):
    """out[p, j, q] = x[p, 0, q] + ... + x[p, j, q] (reverse: x[p, j, q] + ... + x[p, n-1, q])."""
    n = x.shape[1]
    if n == 0:
        return
    first = n - 1 if reverse else 0
    for p in range(x.shape[0]):
        for q in range(x.shape[2]):
            out[p, first, q] = x[p, first, q]
        for k in range(1, n):
            j = n - 1 - k if reverse else k
            before = j + 1 if reverse else j - 1
            for q in range(x.shape[2]):
                out[p, j, q] = out[p, before, q] + x[p, j, q]


__all__ = ["cumsum_strided"]


@emits("cumsum")
def emit_cumsum(ctx: OpEmitter, node: Value, out: str) -> list[str]:
    (x,) = node.inputs
    pre, n, post = ctx.split(x.shape, node.attrs["axis"])
    view = f"(({pre}, {n}, {post}))"
    return [
        f"cumsum_strided({ctx.array(x)}.reshape{view}, {out}.reshape{view}, "
        f"{node.attrs['reverse']})"
    ]
