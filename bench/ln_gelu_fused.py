"""backplan's ln_gelu step against the same step hand-fused in Numba: what a user who writes
the loops and the derivative by hand gets, the bar the compiler should come near (issue
target: within 1.3x (BENCHMARKS.md, 36), and no slower with 2 threads than with 1).

    python -m backplan.bench.ln_gelu_fused --threads 1 --rounds 9 [--shape 4096,1024]

--against-path DIR: this installation against a package copy of another revision, in fresh
processes alternated (bench/ln_gelu_against.py), each side's tanh error beside its times.

The step is the bench model's (bench/models/ln_gelu.py): y = gelu(layer_norm(x) * g + b) + x,
loss = sum(y * upstream), gradients of x, g and b, float32. The hand-fused kernel does the
whole step in one sweep over the rows, each row's forward and backward while it is in L1
(upstream is known before the step, so nothing is saved between them), with the vectorising
tanh backplan's kernels use (codegen/kernels/mathlib.py) and, with threads, rows split across them
and
per-thread column sums for g and b. Both are checked against a float64 NumPy reference;
rounds are interleaved and the table has medians.
"""

from __future__ import annotations

import argparse
import sys

import numba
import numpy as np

from backplan.bench.internals import tanh_f32

from .affinity import current_affinity, pin_process
from .environment import cpu_name, load_average
from .measure import interleaved_medians, max_relative_error
from .threads import apply_threads

GELU_K, GELU_C = 0.7978845608028654, 0.044715
_opts = {"fastmath": True, "error_model": "numpy", "nogil": True, "cache": False}


def _row(x, g, b, up, dx, dg, db, eps):
    """One row's forward and backward; returns its share of the loss."""
    cols = x.shape[0]
    k, c = np.float32(GELU_K), np.float32(GELU_C)
    half, one, three = np.float32(0.5), np.float32(1.0), np.float32(3.0)
    total = np.float32(0.0)
    for j in range(cols):
        total += x[j]
    mean = total / np.float32(cols)
    spread = np.float32(0.0)
    for j in range(cols):
        spread += (x[j] - mean) * (x[j] - mean)
    rstd = one / np.sqrt(spread / np.float32(cols) + np.float32(eps))
    loss = np.float32(0.0)
    sum_dxhat = np.float32(0.0)
    sum_dxhat_xhat = np.float32(0.0)
    for j in range(cols):
        xhat = (x[j] - mean) * rstd
        pre = xhat * g[j] + b[j]
        t = tanh_f32(k * (pre + c * pre * pre * pre))
        loss += (half * pre * (one + t) + x[j]) * up[j]
        slope = half * (one + t) + half * pre * (one - t * t) * k * (one + three * c * pre * pre)
        d_pre = up[j] * slope
        dg[j] += d_pre * xhat
        db[j] += d_pre
        dxhat = d_pre * g[j]
        dx[j] = dxhat
        sum_dxhat += dxhat
        sum_dxhat_xhat += dxhat * xhat
    mean_dxhat = sum_dxhat / np.float32(cols)
    mean_dxhat_xhat = sum_dxhat_xhat / np.float32(cols)
    for j in range(cols):
        xhat = (x[j] - mean) * rstd
        dx[j] = up[j] + rstd * (dx[j] - mean_dxhat - xhat * mean_dxhat_xhat)
    return loss


_row_jit = numba.njit(inline="always", **_opts)(_row)


def _fused_step(x, g, b, up, dx, dg_parts, db_parts, eps):
    """dg_parts, db_parts: (chunks, cols) per-chunk column sums, reduced by the caller."""
    rows = x.shape[0]
    chunks = dg_parts.shape[0]
    losses = np.zeros(chunks, np.float32)
    for part in numba.prange(chunks):
        dg_parts[part, :] = 0
        db_parts[part, :] = 0
        for r in range(part * rows // chunks, (part + 1) * rows // chunks):
            losses[part] += _row_jit(x[r], g, b, up[r], dx[r], dg_parts[part], db_parts[part], eps)
    return losses.sum()


# One thread: the serial loop (a parallel region costs its start-up on every call).
fused_step_serial = numba.njit(**_opts)(_fused_step)
fused_step_parallel = numba.njit(parallel=True, **_opts)(_fused_step)


def hand_fused(params, upstream, threads: int):
    x, g, b = (params[name].astype(np.float32) for name in ("x", "g", "b"))
    up = upstream.astype(np.float32)
    dx = np.empty_like(x)
    dg_parts = np.empty((threads, x.shape[1]), np.float32)
    db_parts = np.empty_like(dg_parts)

    fused_step = fused_step_serial if threads == 1 else fused_step_parallel

    def step():
        loss = fused_step(x, g, b, up, dx, dg_parts, db_parts, 1e-5)
        return loss, [dx, dg_parts.sum(axis=0), db_parts.sum(axis=0)]

    return step


def backplan_step(params, upstream):
    import backplan as bp
    from backplan.bench.internals import driver_builder
    from backplan.bench.models.ln_gelu import loss

    args = {name: bp.tensor(value.astype(np.float32)) for name, value in params.items()}
    up = bp.tensor(upstream.astype(np.float32))
    fn = bp.value_and_grad(bp.compile(loss))
    fn(args, up)
    driver_builder.wait_for_builds()

    def step():
        value, grads = fn(args, up)
        return float(value.numpy()), [grads[name].numpy() for name in ("x", "g", "b")]

    return step


def reference(params, upstream):
    """Loss and gradients of x, g, b in float64 NumPy (bench/peers/numpy_ln_gelu.py)."""
    from .peers.numpy_ln_gelu import backward, forward

    p64 = {name: value.astype(np.float64) for name, value in params.items()}
    value, cache = forward(p64, upstream.astype(np.float64))
    grads = backward(p64, cache)
    return value, [grads[name] for name in ("x", "g", "b")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--shape", default="4096,1024", help="rows,cols")
    parser.add_argument("--seconds", type=float, default=0.5, help="timed per peer and round")
    parser.add_argument("--against-path", help="a package copy's folder: an A/B of both steps")
    parser.add_argument("--processes", type=int, default=3, help="a side, with --against-path")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="--against-path")
    args = parser.parse_args(argv)
    rows, cols = (int(n) for n in args.shape.split(","))
    if args.against_path:
        from .ln_gelu_against import against, against_text

        found = against(
            args.against_path,
            args.threads,
            args.processes,
            args.rounds,
            args.seconds,
            (rows, cols),
            args.clock,
        )
        print(f"python -m backplan.bench.ln_gelu_fused {' '.join(argv or sys.argv[1:])}")
        print(
            f"CPU {cpu_name()}, affinity {current_affinity()}, {args.threads} thread(s); load "
            f"{load_average()}"
        )
        print(against_text(found))
        return 0
    settings = pin_process(args.threads)
    settings |= apply_threads(args.threads)
    rng = np.random.default_rng(0)
    params = {
        "x": rng.standard_normal((rows, cols)),
        "g": 1.0 + 0.1 * rng.standard_normal(cols),
        "b": 0.1 * rng.standard_normal(cols),
    }
    upstream = rng.standard_normal((rows, cols)) / np.sqrt(rows * cols)
    peers = {
        "backplan": backplan_step(params, upstream),
        "hand-fused Numba": hand_fused(params, upstream, args.threads),
    }
    want_value, want = reference(params, upstream)
    errors = {}
    for name, step in peers.items():
        value, grads = step()
        errors[name] = max(
            max_relative_error(grads, want), abs(value - want_value) / abs(want_value)
        )
    load_before = load_average()
    medians = interleaved_medians(peers, args.rounds, args.seconds)
    shapes = f"x, upstream: ({rows}, {cols}) float32; g, b: ({cols},)"
    heading = (f"python -m backplan.bench.ln_gelu_fused {' '.join(argv or sys.argv[1:])}", shapes)
    print_against_hand_fused(heading, args.threads, load_before, settings, medians, errors)
    return 0 if all(e < 1e-3 for e in errors.values()) else 1


def print_against_hand_fused(
    heading, threads, load_before, settings, medians, errors, unit="ms", scale=1.0
) -> None:
    """The table both hand-fused benches print: each peer's median beside the hand-fused step's,
    under the command, the CPU, the affinity and the load the numbers were taken at."""
    print(heading[0])
    print(
        f"CPU {cpu_name()}, affinity {current_affinity()}, {threads} thread(s); "
        f"load {load_before} -> {load_average()}; {settings}"
    )
    for line in heading[1:]:
        print(line)
    print(f"{'peer':18} {'median ' + unit:>10} {'x hand-fused':>13} {'max rel err':>12}")
    for name, value in medians.items():
        ratio = value / medians["hand-fused Numba"]
        print(f"{name:18} {value * scale:10.2f} {ratio:13.2f} {errors[name]:12.1e}")


if __name__ == "__main__":
    sys.exit(main())
