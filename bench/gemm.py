"""GFLOP/s of backplan's own GEMM against the BLAS that plans otherwise call, per shape.

Run by hand: ``python -m backplan.bench.gemm [--threads T] [--rounds R] [--isa avx512|avx2]``.
The process pins itself to T CPUs (os.sched_setaffinity; default 1) before any BLAS loads, so
every library runs on the same T cores; with T > 1 backplan runs its parallel GEMM. Rounds are
interleaved (each round times every shape and library once) and the table shows medians with
the spread (min-max) across rounds; each round's value is the best of several ~2 ms samples, so
a neighbour's burst on a shared machine spoils one sample, not the round. OpenBLAS's kernels
depend on OPENBLAS_CORETYPE, read when it loads: run once with and once without it set; the
first line names it. torch and jax are timed too when installed (own/torch: backplan's rate
over torch's; torch/peak beside own/peak), jax on one Eigen thread at T = 1.

`--models mlp,transformer,mlp_deep,cnn` times every GEMM shape of those models' value_and_grad
steps instead of the fixed list (model_gemms.py), "backplan" on the GEMM explain names for each
(its blocked GEMM on one core or N, its narrow GEMM, or BLAS), at the run's thread count.

`--dtype bf16`: bfloat16 operands, float32 result. backplan's GEMM reads them as they are
(VDPBF16PS on k-pairs where the CPU has AVX512_BF16, else widening while it packs: the first
line names the path); "bp widen" is the widening path in the same rounds, "bp f32" backplan's
float32 GEMM of the same shape (float32 operands), "bf16/f32" backplan's bf16 rate over it;
"openblas" is what plans did before, each operand widened into a float32 copy and then
OpenBLAS's sgemm; torch multiplies its bfloat16 tensors (a bfloat16 result). 2-D shapes only
(batched bf16 products keep their float32 path).
"""

from __future__ import annotations

import argparse
import os
import statistics

from .measure import batch_for, best_ms

# name: (batch, m, k, n, trans_a, trans_b); op(A) is m x k, op(B) is k x n.
SHAPES = {
    "mlp fwd 128x784@784x512": (0, 128, 784, 512, False, False),
    "mlp dW 784x128^T@128x512": (0, 784, 128, 512, True, False),
    "mlp dX 128x512@784x512^T": (0, 128, 512, 784, False, True),
    "mlp2 fwd 128x512@512x512": (0, 128, 512, 512, False, False),
    "mlp2 dW 512x128^T@128x512": (0, 512, 128, 512, True, False),
    "mlp2 dX 128x512@512x512^T": (0, 128, 512, 512, False, True),
    "deep fwd 256x128@128x128": (0, 256, 128, 128, False, False),
    "deep dW 128x256^T@256x128": (0, 128, 256, 128, True, False),
    "deep dX 256x128@128x128^T": (0, 256, 128, 128, False, True),
    "tf fwd 1024x256@256x256": (0, 1024, 256, 256, False, False),
    "tf dW 256x1024^T@1024x256": (0, 256, 1024, 256, True, False),
    "tf dX 1024x256@256x256^T": (0, 1024, 256, 256, False, True),
    "attn 32x(128x64@(128x64)^T)": (32, 128, 64, 128, False, True),
    "attn 32x(128x128@128x64)": (32, 128, 128, 64, False, False),
}


def _operands(shape, dtype):
    import numpy as np

    batch, m, k, n, ta, tb = shape
    rng = np.random.default_rng(0)
    lead = (batch,) if batch else ()
    a = rng.standard_normal(lead + ((k, m) if ta else (m, k))).astype(dtype)
    b = rng.standard_normal(lead + ((n, k) if tb else (k, n))).astype(dtype)
    return a, b, np.empty(lead + (m, n), dtype)


def _bf16_runners(shape, width):
    """bfloat16 operands: the own GEMM reading them, widened copies + OpenBLAS, torch."""
    import ml_dtypes
    import numpy as np

    from backplan.bench.internals import blas
    from backplan.bench.internals import own_gemm as gemm

    _, m, k, n, ta, tb = shape
    a32, b32, c = _operands(shape, np.float32)
    a, b = a32.astype(ml_dtypes.bfloat16), b32.astype(ml_dtypes.bfloat16)
    bits_a, bits_b = a.view(np.uint16), b.view(np.uint16)
    wide_a, wide_b = np.empty_like(a32), np.empty_like(b32)

    def widened_blas():
        np.copyto(wide_a, a, casting="unsafe")
        np.copyto(wide_b, b, casting="unsafe")
        blas.gemm_f32(ta, tb, wide_a, wide_b, c, 0.0)

    runners = {
        "backplan": lambda: gemm.gemm(width, ta, tb, 1.0, bits_a, bits_b, 0.0, c),
        "bp widen": _widening_path(width, ta, tb, bits_a, bits_b, c),
        "bp f32": lambda: gemm.gemm(width, ta, tb, 1.0, a32, b32, 0.0, c),
        "openblas": widened_blas,
    }
    peers = _peer_runners(a32, b32, ta, tb, bf16=True)
    runners.update({k: v for k, v in peers.items() if k == "torch"})
    return runners


def _widening_path(width, ta, tb, a, b, c):
    """The bfloat16 GEMM that widens operands while packing, called by address whichever path
    this process publishes."""
    from backplan.bench.internals import gemm_symbols

    m, n = c.shape
    k = a.shape[0] if ta else a.shape[1]
    args = (width, ta, tb, m, n, k, a.ctypes.data, *a.strides, b.ctypes.data, *b.strides)
    args += (c.ctypes.data, *c.strides, 1.0, 0.0)
    return lambda: gemm_symbols._gemm_bf16(*args)


def _runners(shape, dtype, width, threads, path=None):
    """name -> zero-argument callable doing the GEMM once. `path` (model_gemms.py: "own",
    "own xN", "narrow", "blas"): "backplan" is the GEMM the model's plan calls for the shape;
    None: backplan's blocked GEMM, on every thread of the run."""
    import numpy as np

    if dtype == "bf16":
        return _bf16_runners(shape, width)
    if path is not None:
        return _plan_runners(shape, dtype, width, path)

    from backplan.bench.internals import blas
    from backplan.bench.internals import gemm_parallel as parallel
    from backplan.bench.internals import own_gemm as gemm

    batch, m, k, n, ta, tb = shape
    a, b, c = _operands(shape, dtype)
    f32 = dtype == np.float32
    if batch:
        blas_fn = blas.batched_gemm_f32 if f32 else blas.batched_gemm_f64
        runners = {
            "backplan": (lambda: parallel.batched_gemm_parallel(width, ta, tb, a, b, c))
            if threads > 1
            else (lambda: gemm.batched_gemm(width, ta, tb, a, b, c)),
            "openblas": lambda: blas_fn(ta, tb, a, b, c),
        }
    else:
        blas_fn = blas.gemm_f32 if f32 else blas.gemm_f64
        runners = {
            "backplan": (lambda: parallel.gemm_parallel(threads, width, ta, tb, 1.0, a, b, 0.0, c))
            if threads > 1
            else (lambda: gemm.gemm(width, ta, tb, 1.0, a, b, 0.0, c)),
            "openblas": lambda: blas_fn(ta, tb, a, b, c, 0.0),
        }
        if threads > 1:  # the same GEMM on the calling thread alone: what sharing gains
            runners["bp 1 thread"] = lambda: gemm.gemm(width, ta, tb, 1.0, a, b, 0.0, c)
    runners.update(_peer_runners(a, b, ta, tb))
    return runners


def _plan_runners(shape, dtype, width, path) -> dict:
    """'backplan' on the GEMM a plan calls (path), beside OpenBLAS, torch and JAX."""
    from backplan.bench.internals import blas, narrow_gemm_at, row_dots
    from backplan.bench.internals import gemm_parallel as parallel
    from backplan.bench.internals import own_gemm as gemm

    batch, m, k, n, ta, tb = shape
    a, b, c = _operands(shape, dtype)
    parts = int(path.split("x")[1]) if path.startswith("own x") else 1
    if batch:
        own = (
            (lambda: parallel.batched_gemm_parallel(width, ta, tb, a, b, c))
            if parts > 1
            else (lambda: gemm.batched_gemm(width, ta, tb, a, b, c))
        )
        batched_blas = lambda: blas.batched_gemm_f32(ta, tb, a, b, c)  # noqa: E731
        runners = {"backplan": batched_blas if path == "blas" else own, "openblas": batched_blas}
    else:
        flat_a, flat_b, flat_c = a.reshape(-1), b.reshape(-1), c.reshape(-1)
        own = {
            "own": lambda: gemm.gemm(width, ta, tb, 1.0, a, b, 0.0, c),
            "narrow": lambda: narrow_gemm_at(ta, tb, m, n, k, flat_a, 0, flat_b, 0, flat_c, 0),
            "row dots": lambda: row_dots(a, b, c),  # a @ b.T: the only layout it is chosen for
            "blas": lambda: blas.gemm_f32(ta, tb, a, b, c, 0.0),
        }.get(path, lambda: parallel.gemm_parallel(parts, width, ta, tb, 1.0, a, b, 0.0, c))
        runners = {"backplan": own, "openblas": lambda: blas.gemm_f32(ta, tb, a, b, c, 0.0)}
    runners.update(_peer_runners(a, b, ta, tb))
    return runners


def _peer_runners(a, b, ta, tb, bf16=False) -> dict:
    import importlib.util

    peers = {}
    if importlib.util.find_spec("torch") is not None:
        import torch

        torch.set_num_threads(len(os.sched_getaffinity(0)))
        ta_, tb_ = torch.from_numpy(a), torch.from_numpy(b)
        if bf16:
            ta_, tb_ = ta_.to(torch.bfloat16), tb_.to(torch.bfloat16)
        ta_ = ta_.transpose(-1, -2) if ta else ta_
        tb_ = tb_.transpose(-1, -2) if tb else tb_
        peers["torch"] = lambda: torch.matmul(ta_, tb_)
    if importlib.util.find_spec("jax") is not None:
        import jax
        import jax.numpy as jnp

        fn = jax.jit(
            lambda x, y: jnp.matmul(
                jnp.swapaxes(x, -1, -2) if ta else x, jnp.swapaxes(y, -1, -2) if tb else y
            )
        )
        ja, jb = jnp.asarray(a), jnp.asarray(b)
        peers["jax"] = lambda: fn(ja, jb).block_until_ready()
    return peers


def _gflops(fn, flops: float, samples: int = 8, target_s: float = 0.002) -> float:
    """Best of several short samples (bench/measure.py's best_ms, batches of calls lasting
    target_s): on a shared machine a sample shorter than a scheduler slice is often not
    preempted, so the best is the library's speed, not the neighbours'."""
    reps = batch_for(fn, target_s)
    return flops / best_ms(fn, samples, reps) / 1e6


def measure(rounds: int, dtype_name: str, width: int, threads: int = 1, shapes=SHAPES) -> dict:
    """{shape: {library: [GFLOP/s per round]}}, rounds interleaved over shapes and libraries.
    A shape is (batch, m, k, n, trans_a, trans_b) or a model_gemms.GemmShape (its plan's
    GEMM as "backplan")."""
    import numpy as np

    dtype = {"f32": np.float32, "f64": np.float64}.get(dtype_name, dtype_name)
    paths = {name: getattr(shape, "path", None) for name, shape in shapes.items()}
    shapes = {name: getattr(shape, "shape", shape) for name, shape in shapes.items()}
    if dtype_name == "bf16":
        shapes = {name: shape for name, shape in shapes.items() if not shape[0]}
    runners = {
        name: _runners(shape, dtype, width, threads, paths[name]) for name, shape in shapes.items()
    }
    for fns in runners.values():  # compile and warm
        for fn in fns.values():
            fn()
    results = {name: {lib: [] for lib in fns} for name, fns in runners.items()}
    for turn in range(rounds):
        for name, fns in runners.items():
            batch, m, k, n, _, _ = shapes[name]
            flops = 2.0 * max(batch, 1) * m * k * n
            libs = list(fns)
            # each round starts at the next library: none is always timed right after the
            # same neighbour (a pool thread another library left spinning slows what follows)
            for lib in libs[turn % len(libs) :] + libs[: turn % len(libs)]:
                results[name][lib].append(_gflops(fns[lib], flops))
    return results


def format_table(results: dict, peak: float | None = None) -> str:
    """One row per shape: each library's median (min-max) GFLOP/s, own over OpenBLAS, and
    with `peak` (GFLOP/s of all the process's cores) backplan's share of it. Batched shapes
    have no "bp 1 thread" (a dash)."""
    libs = list(dict.fromkeys(lib for per_lib in results.values() for lib in per_lib))
    header = f"{'shape':32s}" + "".join(f"{lib:>22s}" for lib in libs) + "   own/blas"
    header += "   bf16/f32" if "bp f32" in libs else ""
    header += "    own/1t" if "bp 1 thread" in libs else ""
    header += "  own/torch" if "torch" in libs else ""
    header += "   own/peak" if peak else ""
    lines = [header + (" torch/peak" if peak and "torch" in libs else "")]
    for name, per_lib in results.items():
        row = f"{name:32s}"
        for lib in libs:
            values = per_lib.get(lib)
            if not values:
                row += f"{'-':>22s}"
                continue
            row += f"{statistics.median(values):8.1f} ({min(values):5.1f}-{max(values):5.1f})"
        own = statistics.median(per_lib["backplan"])
        row += f"   {own / statistics.median(per_lib['openblas']):8.2f}"
        if "bp f32" in per_lib:
            row += f"   {own / statistics.median(per_lib['bp f32']):8.2f}"
        if "bp 1 thread" in libs:
            alone = per_lib.get("bp 1 thread")
            row += f"   {own / statistics.median(alone):8.2f}" if alone else f"   {'-':>8s}"
        torch = statistics.median(per_lib["torch"]) if per_lib.get("torch") else None
        if "torch" in libs:
            row += f"   {own / torch:8.2f}" if torch else f"   {'-':>8s}"
        if peak:
            row += f"   {own / peak:8.0%}" + (f"   {torch / peak:8.0%}" if torch else "")
        lines.append(row)
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="CPUs to pin to (the last T)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dtype", choices=("f32", "f64", "bf16"), default="f32")
    parser.add_argument("--isa", choices=("avx512", "avx2"), default=None)
    parser.add_argument(
        "--models",
        default=None,
        help="comma-separated bench models (mlp,transformer,mlp_deep,cnn): time every GEMM "
        "shape of their value_and_grad steps on the GEMM explain names for it, not the fixed list",
    )
    args = parser.parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))[-args.threads :]
    os.sched_setaffinity(0, cpus)  # before OpenBLAS loads: it sizes its pool from the mask
    from .threads import prepare_jax_threads

    # before jax loads: at one thread XLA's Eigen pool is off, as in the model harness (its
    # thread, left spinning after a call, ran whatever was timed next at 1/5 of its rate:
    # OpenBLAS's 32x10x128 product at 10 against 48 GFLOP/s)
    prepare_jax_threads(len(cpus), jax_selected=True)
    from backplan.bench.internals import ISA_WIDTH, active_isa

    from .environment import cpu_name

    isa = args.isa or active_isa()
    path = ""
    if args.dtype == "bf16":
        from backplan.bench.internals import bf16_gemm_path

        path = f" (bf16 path {bf16_gemm_path()})"
    print(
        f"CPU {cpu_name()} pinned to cpus {cpus}; {args.dtype}; backplan ISA {isa}{path}; "
        f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')}; "
        f"{args.rounds} interleaved rounds, GFLOP/s median (min-max)"
    )
    from .peak_flops import peak_gflops_f32

    width = ISA_WIDTH[isa]
    # VDPBF16PS does the work of two float32 FMAs per issue: bf16's peak is twice float32's
    scale = {"f64": 0.5, "bf16": 2.0 if path.endswith("dot)") else 1.0}.get(args.dtype, 1.0)
    per_core = peak_gflops_f32(width) * scale
    print(f"measured FMA peak at {width} bits: {per_core:.1f} {args.dtype} GFLOP/s per core")
    shapes = SHAPES
    if args.models:
        from .model_gemms import shapes_of
        from .threads import apply_threads

        apply_threads(len(cpus))  # the plans' GEMM choices depend on the threads
        shapes = shapes_of(args.models.split(","))
        print(f"shapes of {args.models}'s value_and_grad steps, 'backplan' on the GEMM each calls")
    results = measure(args.rounds, args.dtype, width, len(cpus), shapes)
    print(format_table(results, per_core * len(cpus)))


if __name__ == "__main__":
    main()
