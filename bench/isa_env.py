"""An AVX2 machine emulated on an AVX-512 one, for every peer at once, and proof that it took.

Issue 36's targets hold "on AVX2 and on AVX-512"; where only an AVX-512 CPU is at hand, each
library can be told to use no instruction past AVX2 (the CPU's caches and clock stay its own):

    backplan, Numba  NUMBA_CPU_NAME=znver3 and NUMBA_CPU_FEATURES = the host's with every
                     AVX-512 (and AVX-VNNI, AMX, AVX10) feature off: every kernel compiles for
                     AVX2, and the GEMM takes its 256-bit tile (gemm/isa.py reads the features)
    NumPy, SciPy     OPENBLAS_CORETYPE=Haswell: OpenBLAS's AVX2 kernels
    torch            ATEN_CPU_CAPABILITY=avx2 (ATen's own vector kernels),
                     MKL_ENABLE_INSTRUCTIONS=AVX2 (MKL's sgemm), ONEDNN_MAX_CPU_ISA=AVX2 (oneDNN)
    JAX              XLA_FLAGS=--xla_cpu_max_isa=AVX2 (appended to any XLA_FLAGS set)

Two libraries pick some kernels by CPUID whatever these say (seen with `perf record` on a Zen 4
core, jax 0.10.2 and torch 2.14's MKL 2024.2): XLA runs its matmuls as YNNPACK fusions, whose
dot kernels stay AVX-512 (`ynn::dot_fp32_5x64x1_1x16x1_avx512`, zmm registers) under
--xla_cpu_max_isa=AVX2 (only XLA's own generated code is capped; no flag caps YNNPACK, and
--xla_cpu_experimental_ynn_fusion_type=reduce drops its dots altogether, another algorithm),
so JAX's GEMMs here are an AVX-512 JAX's; MKL's sgemm on an AMD CPU is its AVX2 kernel
(`mkl_blas_def_sgemm_kernel_0_zen`, ymm only) with or without MKL_ENABLE_INSTRUCTIONS, so
torch's GEMMs are AVX2 either way. On a core whose 512-bit FMAs are double-pumped (Zen 4)
both widths have the same FMA peak: there the emulation changes instructions, tiles and
register counts, not the peak.

    python -m backplan.bench.isa_env avx2            # the assignments, for `env` or a shell
    python -m backplan.bench.isa_env avx2 --check    # each peer, in a child with them, reports

`--check` asks each library what it runs: backplan its GEMM path and the zmm registers in its
compiled GEMM's machine code (none on AVX2), torch its ATen capability and what MKL_VERBOSE
and ONEDNN_VERBOSE name, OpenBLAS its core type (threadpoolctl), and for every GEMM library
the rate of one 256^3 float32 product on one core against the 256-bit FMA peak: a library
over that peak still runs 512-bit code (where 512-bit FMAs are faster than 256-bit ones).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys

OFF_PREFIXES = ("avx512", "avxvnni", "avxifma", "avxneconvert", "amx", "avx10", "evex512")
AVX2_CPU = "znver3"  # an AVX2-only core LLVM knows (Zen 3); haswell also works


def avx2_features(host_features: str) -> str:
    """LLVM's host feature string with every feature past AVX2 turned off.

    >>> avx2_features("+avx2,+avx512f,+fma,-amx-tile,+avxvnni,+evex512")
    '+avx2,-avx512f,+fma,-amx-tile,-avxvnni,-evex512'
    """
    out = []
    for flag in filter(None, host_features.split(",")):
        name = flag[1:]
        out.append(f"-{name}" if name.startswith(OFF_PREFIXES) else flag)
    return ",".join(out)


def isa_env(isa: str, base: dict | None = None) -> dict[str, str]:
    """The environment variables (beyond `base`, default os.environ) that cap every peer at
    `isa` ("avx2"); "native" adds nothing."""
    base = os.environ if base is None else base
    if isa == "native":
        return {}
    from llvmlite import binding

    xla = f"{base.get('XLA_FLAGS', '')} --xla_cpu_max_isa=AVX2".strip()
    return {
        "NUMBA_CPU_NAME": AVX2_CPU,
        "NUMBA_CPU_FEATURES": avx2_features(binding.get_host_cpu_features().flatten()),
        "OPENBLAS_CORETYPE": "Haswell",
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "XLA_FLAGS": xla,
    }


def _fresh_kernel_asm() -> str:
    """Machine code Numba compiles now (never from a cache) for a vectorisable float32 sum."""
    import numpy as np
    from numba import njit

    @njit(fastmath=True)
    def total(x):
        acc = np.float32(0.0)
        for i in range(x.size):
            acc += x[i] * x[i]
        return acc

    total(np.ones(64, np.float32))
    return "\n".join(total.inspect_asm().values())


def _rate(fn, flops: float) -> float:
    from .measure import batch_for, best_ms

    fn()
    return flops / best_ms(fn, 20, batch_for(fn, 0.01)) / 1e6


def report() -> dict:
    """What each library in this process says it runs, and its 256^3 GEMM rate on one core
    (run pinned to one CPU, in a child started with the environment under test)."""
    import numpy as np

    from backplan.bench.internals import ISA_WIDTH, active_isa
    from backplan.bench.internals import own_gemm as gemm

    from .peak_flops import peak_gflops_f32

    n = 256
    flops = 2.0 * n**3
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n)).astype(np.float32) for _ in range(2))
    c = np.empty((n, n), np.float32)
    width = ISA_WIDTH[active_isa()]
    asm = _fresh_kernel_asm()
    facts = {
        "backplan GEMM tile": f"{active_isa()} ({width} bits)",
        "numba target": os.environ.get("NUMBA_CPU_NAME") or "host",
        "zmm / ymm in fresh code": f"{asm.count('zmm')} / {asm.count('ymm')}",
        "peak 256-bit GFLOP/s": round(peak_gflops_f32(256), 1),
        "peak 512-bit GFLOP/s": round(peak_gflops_f32(512), 1),
        "backplan GFLOP/s": round(_rate(lambda: gemm.gemm(width, 0, 0, 1.0, a, b, 0.0, c), flops)),
        "numpy GFLOP/s": round(_rate(lambda: np.matmul(a, b, out=c), flops)),
    }
    try:
        from threadpoolctl import threadpool_info

        facts["openblas"] = [p.get("architecture") for p in threadpool_info()]
    except ImportError:
        pass
    try:
        import torch

        torch.set_num_threads(1)
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        facts["torch capability"] = torch.backends.cpu.get_cpu_capability()
        facts["torch GFLOP/s"] = round(_rate(lambda: torch.mm(ta, tb), flops))
    except ImportError:
        pass
    try:
        import jax
        import jax.numpy as jnp

        ja, jb = jnp.asarray(a), jnp.asarray(b)
        product = jax.jit(jnp.matmul)
        facts["jax GFLOP/s"] = round(_rate(lambda: product(ja, jb).block_until_ready(), flops))
    except ImportError:
        pass
    return facts


def _verbose_isa(env: dict, cpu: int) -> dict:
    """The ISA lines MKL and oneDNN print for one torch product and one convolution."""
    code = (
        "import torch; torch.set_num_threads(1); a = torch.ones(256, 256); a @ a; "
        "torch.nn.functional.conv2d(torch.ones(1, 8, 16, 16), torch.ones(8, 8, 3, 3))"
    )
    verbose = dict(env, MKL_VERBOSE="1", ONEDNN_VERBOSE="1")
    done = subprocess.run(
        ["taskset", "-c", str(cpu), sys.executable, "-c", code],
        env=verbose,
        capture_output=True,
        text=True,
    )
    lines = done.stdout.splitlines() + done.stderr.splitlines()
    mkl = [line for line in lines if line.startswith("MKL_VERBOSE oneMKL")]
    dnnl = [line for line in lines if "cpu,runtime" in line or ",isa:" in line]
    return {
        "MKL_VERBOSE": mkl[0] if mkl else "(none printed)",
        "ONEDNN_VERBOSE": dnnl[0] if dnnl else "(none printed: oneDNN not called)",
    }


def check(isa: str, cpu: int) -> dict:
    """report() in a child pinned to `cpu` with the environment for `isa`."""
    env = dict(os.environ, **isa_env(isa))
    code = "import json; from backplan.bench.isa_env import report; print(json.dumps(report()))"
    done = subprocess.run(
        ["taskset", "-c", str(cpu), sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    facts.update(_verbose_isa(env, cpu))
    return facts


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("isa", choices=("avx2", "native"))
    parser.add_argument("--check", action="store_true", help="report what each peer runs")
    parser.add_argument("--cpu", type=int, default=0, help="the CPU --check pins its child to")
    args = parser.parse_args(argv)
    if not args.check:
        for name, value in isa_env(args.isa).items():
            print(f"{name}={shlex.quote(value)}")
        return
    for name, value in check(args.isa, args.cpu).items():
        print(f"{name:24s} {value}")


if __name__ == "__main__":
    main()
