"""GFLOP/s of the fused attention kernels against the GEMMs they run, on the same shapes.

Per (batch, head) pair, forward runs two products, scores = Q K^T and out = P V, and backward
five (P recomputed, dP = G V^T, dV = P^T G, dQ = dS K, dK = dS^T Q); the softmax rows, the
mask and dS = P * (dP - rowsum(P * dP)) are the work between them. Both sides are timed on one
batch element's heads (calls of a millisecond or less, which a loaded machine interrupts less
often than longer ones) and rated on the products' FLOPs only, so the ratio is the time the
GEMMs alone take over the kernel's time: how close attention runs to the GEMM rate. The GEMM
side is the own GEMM's batched entry (one compiled loop over the heads), at the kernels'
register width.
"""

from __future__ import annotations

import numpy as np

from .measure import interleaved_medians


def product_flops(heads: int, length: int, features: int) -> dict[str, int]:
    """The products' FLOPs per direction for `heads` pairs of (length, features) q, k, v."""
    one = 2 * length * length * features
    return {"forward": 2 * one * heads, "backward": 5 * one * heads}


def _runners(q, k, v, g, scale: float, tile: int) -> dict:
    """name -> zero-argument call: the kernels and the GEMMs alone, on q, k, v, g."""
    from backplan.bench.internals import attention_kernels, own_gemm

    width = own_gemm.vector_width()
    heads, length = q.shape[1], q.shape[2]
    out, dq, dk, dv = (np.empty_like(q) for _ in range(4))
    flat = [x.reshape(heads, length, -1) for x in (q, k, v, g, dq, dk, dv)]
    fq, fk, fv, fg, fdq, fdk, fdv = flat
    p, ds = (np.empty((heads, length, length), q.dtype) for _ in range(2))
    gemm = own_gemm.batched_gemm

    def gemm_forward():
        gemm(width, False, True, fq, fk, p)
        gemm(width, False, False, p, fv, fdq)

    def gemm_backward():
        gemm(width, False, True, fq, fk, p)
        gemm(width, False, True, fg, fv, ds)
        gemm(width, True, False, p, fg, fdv)
        gemm(width, False, False, ds, fk, fdq)
        gemm(width, True, False, ds, fq, fdk)

    kernels = attention_kernels
    work = kernels.slot_workspace(q, k, v, tile)  # as a plan's arena holds it
    return {
        "attention forward": lambda: kernels.attention_forward(
            width, q, k, v, out, scale, False, tile, work
        ),
        "GEMMs of forward": gemm_forward,
        "attention backward": lambda: kernels.attention_backward(
            width, q, k, v, g, dq, dk, dv, scale, False, tile, work
        ),
        "GEMMs of backward": gemm_backward,
    }


def kernel_rates(
    heads: int, length: int, features: int, rounds: int, seconds: float, tile: int
) -> dict:
    """{name: GFLOP/s} of each runner, from interleaved medians, float32, non-causal; keys
    beyond `tile` run key-tiled (rated on the five products all the same)."""
    rng = np.random.default_rng(2)
    q, k, v, g = (
        rng.standard_normal((1, heads, length, features)).astype(np.float32) for _ in range(4)
    )
    runners = _runners(q, k, v, g, 1.0 / np.sqrt(features), tile)
    for run in runners.values():
        run()  # compiled (or loaded) outside the timed rounds
    medians = interleaved_medians(runners, rounds, seconds)
    flops = product_flops(heads, length, features)
    return {name: flops[name.split()[-1]] / (ms * 1e-3) / 1e9 for name, ms in medians.items()}


def rate_lines(rates: dict) -> list[str]:
    """The table's lines: each direction's kernel rate, its GEMMs' rate and the ratio."""
    lines = []
    for direction in ("forward", "backward"):
        kernel, gemms = rates[f"attention {direction}"], rates[f"GEMMs of {direction}"]
        lines.append(
            f"{direction:9} kernel {kernel:6.1f} GFLOP/s, its GEMMs alone {gemms:6.1f}: "
            f"{kernel / gemms:.0%} of the GEMM rate"
        )
    return lines
