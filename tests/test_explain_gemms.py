"""explain names the GEMM each matmul calls (BLAS sgemm/dgemm, backplan's GEMM, its narrow GEMM,
the mixed bfloat16 x float32 pair), read from the statements the code generator wrote: checked
against the calls in the generated driver's source (rendered, nothing compiled)."""

from __future__ import annotations

import re

import numpy as np
import pytest

import backplan as bp
from backplan.codegen.render.emit import generate
from backplan.ir.lowering import lower
from backplan.runtime.backend import use_backend

CORES = re.compile(r" on \d+ cores$")
CALL = re.compile(r"\b((?:own_|narrow_)?(?:batched_)?gemm\w*)\(")


def _layers(params, x):
    for w in params:
        x = bp.tanh(x @ w)
    return (x * x).mean()


def _arguments(dtype, n_out=64, rows=128):
    rng = np.random.default_rng(2)
    shapes = [(64, 64), (64, 64), (64, n_out)]
    params = [(rng.standard_normal(s) * 0.3).astype(dtype) for s in shapes]
    return params, rng.standard_normal((rows, 64)).astype(dtype)


def _explained(dtype, saved_dtype=None, n_out=64, rows=128):
    params, x = _arguments(dtype, n_out, rows)
    with use_backend("numba"):
        step = bp.value_and_grad(_layers, saved_dtype=saved_dtype)
        report = step.explain(params, x)
        plan = step.lookup((params, x), {}, count_hit=False)[1].plan
        source = generate(lower(plan)).source.split("\ndef run(")[1]
    by_gemm = {}
    for kernel in report.kernels:
        if kernel.gemm:
            (matmul,) = [s for s in kernel.steps if report.view.steps[s].op == "matmul"]
            gemm = CORES.sub("", kernel.gemm)  # the cores it shares out follow the load
            by_gemm.setdefault(gemm, []).append(report.view.steps[matmul].label)
    return report, by_gemm, CALL.findall(source)


def _matmul_labels(report) -> set[str]:
    return {s.label for s in report.view.steps if s.op == "matmul"}


def test_a_float64_step_names_blas_dgemm_for_every_matmul(monkeypatch):
    monkeypatch.setenv("BACKPLAN_GEMM", "blas")
    report, by_gemm, calls = _explained(np.float64)
    assert set(by_gemm) == {"BLAS dgemm"}
    assert set(by_gemm["BLAS dgemm"]) == _matmul_labels(report)  # every matmul, once
    # 3 products, 3 weight and 2 input gradients
    assert len(by_gemm["BLAS dgemm"]) == len(calls) == 8
    assert all(c in ("gemm_at_f64", "gemm_f64") for c in calls)
    assert "BLAS dgemm computes f0 f64[128,64]" in str(report)


def test_bfloat16_saved_values_name_the_mixed_gemm_and_blas_the_rest(monkeypatch):
    """BACKPLAN_GEMM=blas sends the float32 products to sgemm; those reading a bfloat16 saved
    value cannot go there and run backplan's mixed GEMM, as the driver calls them."""
    monkeypatch.setenv("BACKPLAN_GEMM", "blas")
    # 4,096 rows: at 128 the bfloat16 copies saved less than the mixed GEMM's packing pages
    # cost (codegen/kernels/gemm/packing.py), so none was kept
    report, by_gemm, calls = _explained(np.float32, saved_dtype=bp.bfloat16, rows=4096)
    mixed = "backplan's GEMM (bf16 x f32, mixed)"
    assert set(by_gemm) == {"BLAS sgemm", mixed}
    assert len(by_gemm[mixed]) == 2  # the weight gradients of layers 2 and 3 read bf16 tanh
    assert all(label.startswith("b") for label in by_gemm[mixed])
    own_calls = [c for c in calls if c.startswith("own_")]
    blas_calls = [c for c in calls if c in ("gemm_at_f32", "gemm_f32")]
    assert len(own_calls) == len(by_gemm[mixed]) and len(blas_calls) == len(by_gemm["BLAS sgemm"])
    assert sorted(by_gemm[mixed] + by_gemm["BLAS sgemm"]) == sorted(_matmul_labels(report))
    text = str(report)
    assert re.search(f"{re.escape(mixed)}( on \\d+ cores)? computes {by_gemm[mixed][0]} f32", text)


@pytest.mark.parametrize("choice", ["own", "blas"])
def test_every_matmul_of_a_float32_step_is_named_as_its_driver_calls_it(monkeypatch, choice):
    """Own GEMM calls (alone, on several cores, or with the loop after it run on its row
    blocks), narrow and BLAS ones: each named GEMM matches a call of that kind."""
    monkeypatch.setenv("BACKPLAN_GEMM", choice)
    report, by_gemm, calls = _explained(np.float32, n_out=8)
    assert sorted(sum(by_gemm.values(), [])) == sorted(_matmul_labels(report))
    epilogues = sum(len(v) for k, v in by_gemm.items() if k.endswith("+ epilogue"))
    own = sum(len(v) for k, v in by_gemm.items() if k.startswith("backplan's GEMM"))
    narrow = len(by_gemm.get("backplan's narrow GEMM", []))
    blas = len(by_gemm.get("BLAS sgemm", []))
    assert own - epilogues == sum(c.startswith("own_") for c in calls)
    assert narrow == sum(c == "narrow_gemm_at" for c in calls)
    assert blas == sum(c in ("gemm_at_f32", "gemm_f32") for c in calls)
    if choice == "own":
        assert blas == 0 and own == 8
    else:
        assert own == 0


def test_a_narrow_product_names_the_narrow_gemm_where_it_runs(monkeypatch):
    """One BLAS thread, on a CPU where backplan's GEMM wins small products: the 8-column
    product x @ w3 (512 x 8 x 64) runs on the narrow GEMM, and explain says so."""
    from backplan.codegen.kernels.gemm.choice import small_products_own

    if not small_products_own():
        pytest.skip("the narrow GEMM is chosen only where small products were measured ahead")
    monkeypatch.setenv("BACKPLAN_GEMM", "auto")
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    report, by_gemm, calls = _explained(np.float32, n_out=8, rows=512)
    assert by_gemm["backplan's narrow GEMM"] == ["f4"]
    assert calls.count("narrow_gemm_at") == 1
    assert "backplan's narrow GEMM computes f4 f32[512,8]" in str(report)


WARM_SCRIPT = """
import numpy as np, backplan as bp
def layers(params, x):
    for w in params:
        x = bp.tanh(x @ w)
    return (x * x).mean()
rng = np.random.default_rng(5)
params = [(rng.standard_normal((64, 64)) * 0.1).astype(np.float32) for _ in range(3)]
x = rng.standard_normal((200, 64)).astype(np.float32)
step = bp.value_and_grad(layers, background=False)
step(params, x)
report = step.explain(params, x)
print(report.n_kernels, sorted(k.gemm for k in report.kernels if k.gemm))
"""


def test_a_warm_process_explains_the_gemms_and_kernel_calls_a_cold_one_does(tmp_path):
    """A process that loads a plan's rendering facts from the cache (no rendering) explains
    the same kernel calls and GEMMs as the process that rendered it: the facts keep them.
    Before, the warm process printed no GEMM line and fewer kernels (a BLAS call and its
    epilogue loop counted as one)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "BACKPLAN_CACHE_DIR": str(tmp_path), "BACKPLAN_GEMM": "blas"}
    env["BACKPLAN_BACKEND"] = "numba"
    runs = [
        subprocess.run(
            [sys.executable, "-c", WARM_SCRIPT],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        for _ in range(2)
    ]
    for run in runs:
        assert run.returncode == 0, run.stderr
    cold, warm = (run.stdout.strip().splitlines()[-1] for run in runs)
    assert "BLAS sgemm" in cold
    assert warm == cold
