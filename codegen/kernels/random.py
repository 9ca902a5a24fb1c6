"""Threefry-2x32 kernels for the random ops: the same integer arithmetic as the NumPy reference
in ir/ops/random.py (in int64 with 32-bit masks), so compiled draws are bit-identical to it."""

import math

import numpy as np

from backplan.codegen.jit import njit, prange
from backplan.codegen.kernels.threads_now import threads_now
from backplan.codegen.render.opaque import OpEmitter, emits
from backplan.ir.graph import Value

_opts = {"cache": True, "error_model": "numpy", "nogil": True}  # no fastmath: exact bits
MASK32 = 0xFFFFFFFF
PARALLEL_BLOCKS = 1 << 15


@njit(inline="always", **_opts)
def _rotl(x, r):
    return ((x << r) | (x >> (32 - r))) & MASK32


@njit(inline="always", **_opts)
def _round4(x0, x1, r0, r1, r2, r3):
    x0 = (x0 + x1) & MASK32
    x1 = _rotl(x1, r0) ^ x0
    x0 = (x0 + x1) & MASK32
    x1 = _rotl(x1, r1) ^ x0
    x0 = (x0 + x1) & MASK32
    x1 = _rotl(x1, r2) ^ x0
    x0 = (x0 + x1) & MASK32
    x1 = _rotl(x1, r3) ^ x0
    return x0, x1


@njit(inline="always", **_opts)
def threefry2x32(k0, k1, x0, x1):
    """Random123's threefry-2x32-20 on int64 values holding 32-bit words."""
    k2 = k0 ^ k1 ^ 0x1BD11BDA
    x0 = (x0 + k0) & MASK32
    x1 = (x1 + k1) & MASK32
    x0, x1 = _round4(x0, x1, 13, 15, 26, 6)
    x0, x1 = (x0 + k1) & MASK32, (x1 + k2 + 1) & MASK32
    x0, x1 = _round4(x0, x1, 17, 29, 16, 24)
    x0, x1 = (x0 + k2) & MASK32, (x1 + k0 + 2) & MASK32
    x0, x1 = _round4(x0, x1, 13, 15, 26, 6)
    x0, x1 = (x0 + k0) & MASK32, (x1 + k1 + 3) & MASK32
    x0, x1 = _round4(x0, x1, 17, 29, 16, 24)
    x0, x1 = (x0 + k1) & MASK32, (x1 + k2 + 4) & MASK32
    x0, x1 = _round4(x0, x1, 13, 15, 26, 6)
    return (x0 + k2) & MASK32, (x1 + k0 + 5) & MASK32


@njit(**_opts)
def check_key(key):
    """-1 when both words lie in [0, 2**32), else the first bad word's position."""
    for i in range(2):
        if key[i] < 0 or key[i] > MASK32:
            return i
    return -1


@njit(inline="always", **_opts)
def _uniform_block(k0, k1, j, out, f64):
    y0, y1 = threefry2x32(k0, k1, j >> 32, j & MASK32)
    if f64:
        out[j] = ((y0 >> 5) * 67108864.0 + (y1 >> 6)) * 2.0**-53
        return
    out[2 * j] = (y0 >> 8) * np.float32(2.0**-24)
    if 2 * j + 1 < out.shape[0]:
        out[2 * j + 1] = (y1 >> 8) * np.float32(2.0**-24)


@njit(inline="always", **_opts)
def _normal_block(k0, k1, j, out):
    y0, y1 = threefry2x32(k0, k1, j >> 32, j & MASK32)
    radius = math.sqrt(-2.0 * math.log((y0 + 1.0) * 2.0**-32))
    angle = 2.0 * math.pi * (y1 * 2.0**-32)
    out[2 * j] = radius * math.cos(angle)
    if 2 * j + 1 < out.shape[0]:
        out[2 * j + 1] = radius * math.sin(angle)


@njit(**_opts)
def random_uniform_serial(key, out, f64):
    blocks = out.shape[0] if f64 else (out.shape[0] + 1) // 2
    for j in range(blocks):
        _uniform_block(key[0], key[1], j, out, f64)


@njit(parallel=True, **_opts)
def random_uniform_par(key, out, f64):
    if threads_now() < 2:  # one free core: serial, no pool thread (kernels/threads_now.py)
        random_uniform_serial(key, out, f64)
        return
    blocks = out.shape[0] if f64 else (out.shape[0] + 1) // 2
    for j in prange(blocks):
        _uniform_block(key[0], key[1], j, out, f64)


@njit(**_opts)
def random_normal_serial(key, out):
    for j in range((out.shape[0] + 1) // 2):
        _normal_block(key[0], key[1], j, out)


@njit(parallel=True, **_opts)
def random_normal_par(key, out):
    if threads_now() < 2:
        random_normal_serial(key, out)
        return
    for j in prange((out.shape[0] + 1) // 2):
        _normal_block(key[0], key[1], j, out)


@njit(**_opts)
def random_split(key, out):
    for c in range(out.shape[0]):
        y0, y1 = threefry2x32(key[0], key[1], MASK32, c)
        out[c, 0] = y0
        out[c, 1] = y1


__all__ = [
    "check_key",
    "random_normal_par",
    "random_normal_serial",
    "random_split",
    "random_uniform_par",
    "random_uniform_serial",
]


def _key_check(ctx: OpEmitter, node: Value, key: str) -> list[str]:
    return [
        f"bad = check_key({key})",
        *ctx.index_error(
            node,
            node.inputs[0],
            "key word {value} at position {position} must lie in [0, 2**32); "
            "make keys with bp.random.key",
        ),
    ]


def _draw(ctx: OpEmitter, node: Value, out: str, fn: str, extra: str = "") -> list[str]:
    key = ctx.array(node.inputs[0])
    size = math.prod(node.shape)
    variant = "par" if size >= (1 << 16) else "serial"
    return [*_key_check(ctx, node, key), f"{fn}_{variant}({key}, {out}.reshape(({size},)){extra})"]


@emits("random_uniform")
def emit_random_uniform(ctx: OpEmitter, node: Value, out: str) -> list[str]:
    return _draw(ctx, node, out, "random_uniform", f", {node.dtype == 'f64'}")


@emits("random_normal")
def emit_random_normal(ctx: OpEmitter, node: Value, out: str) -> list[str]:
    return _draw(ctx, node, out, "random_normal")


@emits("random_split")
def emit_random_split(ctx: OpEmitter, node: Value, out: str) -> list[str]:
    key = ctx.array(node.inputs[0])
    return [*_key_check(ctx, node, key), f"random_split({key}, {out})"]
