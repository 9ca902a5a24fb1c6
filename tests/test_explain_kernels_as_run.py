"""explain's kernel count and kernel list are the calls the compiled driver makes: a row kernel
(ln_gelu's step: every loop over the same rows as stages of one loop) is one kernel, not one per
stage; a matmul + epilogue kernel that the code generator runs as a BLAS call and then the loop
is two; a loop whose values are all recomputed where read is none; a kernel that runs as several
calls (a long sum's shared adds, pad_slice's zeroing and copy) counts each; the peak timeline
has one step per call. Checked against the generated driver's source
(rendered, nothing compiled)."""

from __future__ import annotations

import re

import numpy as np
import pytest

import backplan as bp
from backplan.bench.memory_audit import model_step
from backplan.codegen.render.emit import generate
from backplan.ir.lowering import lower
from backplan.runtime.backend import use_backend

CALL = re.compile(r"^    (?:[A-Za-z_]\w* = )?([A-Za-z_]\w*)\(", re.M)
NOT_KERNELS = {"as_read_only", "np"}  # driver helpers, never kernels


def _ln_gelu(x, g, b, up):
    y = bp.gelu(bp.layer_norm(x) * g + b, approximate="tanh") + x
    return bp.sum(y * up)


def _mlp(w1, b1, w2, x, y):
    hidden = bp.tanh(x @ w1 + b1)
    return bp.mse_loss(hidden @ w2, y)


def driver_calls(plan) -> list[str]:
    """The kernels the generated driver `run` calls, in order (views and reshapes excluded)."""
    source = generate(lower(plan)).source
    body = source.split("\ndef run(")[1]
    return [name for name in CALL.findall(body) if name not in NOT_KERNELS]


def f32(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_a_row_kernel_is_one_kernel_in_the_count_the_list_and_the_timeline():
    args = (f32(64, 32), 1 + f32(32, seed=1), f32(32, seed=2), f32(64, 32, seed=3))
    with use_backend("numba"):
        report = bp.value_and_grad(_ln_gelu, argnums=(0, 1, 2)).explain(*args)
    calls = driver_calls(report.plans["joint"])
    assert len(calls) == 1, calls  # the whole step: one loop over the rows
    assert report.n_kernels == len(calls) == report.compiled[0].kernels
    (running,) = [k for k in report.kernels if k.runs_code]
    assert running.stages > 1
    assert len(report.call_peak.steps) == len(calls)
    text = str(report)
    assert "run as 1 kernel on the numba backend" in text
    assert f"k0 (row loop of {running.stages} stages)" in text
    assert not re.search(r"\bk1 \(", text)


def test_a_matmul_and_its_epilogue_count_as_the_driver_runs_them():
    args = (f32(32, 64), f32(64, seed=1), f32(64, 8, seed=2), f32(16, 32, seed=3), f32(16, 8))
    with use_backend("numba"):
        report = bp.value_and_grad(_mlp, argnums=(0, 1, 2)).explain(*args)
    plan = report.plans["joint"]
    calls = driver_calls(plan)
    assert report.n_kernels == len(calls) == report.compiled[0].kernels
    apart = generate(lower(plan)).epilogues_apart
    fused = [k for k in report.kernels if k.epilogue]
    # each epilogue either runs inside the GEMM (one kernel) or after a BLAS call (two)
    assert len(fused) + len(apart) == sum(k.epilogue is not None for k in lower(plan).kernels)
    assert lower(plan).kernel_count + len(apart) == len(calls)
    assert len(report.call_peak.steps) == len(calls)  # the timeline: a step per call


def test_the_reference_backend_runs_one_kernel_per_step():
    args = (f32(8, 4), 1 + f32(4, seed=1), f32(4, seed=2), f32(8, 4, seed=3))
    with use_backend("reference"):
        report = bp.value_and_grad(_ln_gelu, argnums=(0, 1, 2)).explain(*args)
    assert report.n_kernels == len(report.view.steps) and report.fused_kernels == 0


@pytest.mark.parametrize("model", ["lstm12", "transformer", "mlp"])
def test_bench_models_count_every_call_their_drivers_make(model):
    """A loop whose values are all recomputed where read runs no kernel; a long sum of
    gradients runs as several shared adds; pad_slice's gradient zeroes, then copies: each as
    many kernels as the driver calls."""
    step, args, _ = model_step(model, "vg")
    with use_backend("numba"):
        report = step.explain(*args)
    calls = driver_calls(report.plans["joint"])
    assert report.n_kernels == len(calls) == report.compiled[0].kernels
    assert len(report.call_peak.steps) == len(calls)
