"""Every op sample runs in bfloat16 and float16 on both executors, forward and gradients (one
joint plan per batch of samples), within the dtype's tolerance of the same graph in float64 on
inputs holding the same values; the compiled plan gives the reference interpreter's result
within one ulp where both round at the plan's rounding points (ir/rounding_points.py)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from op_samples import DTYPE, OTHER_FLOAT, SAMPLES

from backplan.codegen.run.compiled import CompiledPlan
from backplan.ir.builder import Builder
from backplan.ir.graph import Graph
from backplan.ir.interpreter import run_plan
from backplan.ir.lowering import lower
from backplan.ir.pipeline import build_joint_plan
from backplan.ir.types import TensorType, dtype_name, is_float, np_dtype

# bfloat16 keeps 8 significant bits, float16 11: a few roundings of each, relative to the
# largest value of an output (gradients sum many rounded terms). bf16 is the 1e-2: it
# holds since attention_grad's derivative computes in float32 (its chain rounded after every op
# put the attention_grad samples' gradients at 1.2-1.6e-2)
TOL = {"bf16": 1e-2, "f16": 4e-3}
# compiled results and the reference interpreter's running the lowered plan (rounding where
# the compiled loops store): at most one ulp of the 16-bit result apart (float32 arithmetic's
# last bits before a rounding: another summation order, a cheaper tanh, exp)
ULPS_APART = 1.0
DRAWS_BY_DTYPE = ("random_uniform", "random_normal")  # their float64 draws are other numbers
BATCH = 40


def _samples():
    return [s for s in SAMPLES if "f32" in s.dtypes]


def _attrs(sample, dtype: str) -> dict:
    swap = {DTYPE: dtype, OTHER_FLOAT: "f64" if dtype != "f64" else "f32"}
    return {k: swap.get(v, v) if isinstance(v, str) else v for k, v in sample.attrs.items()}


def _graph(samples, dtype: str, half: str):
    """The samples' ops on `dtype` inputs whose values are those of `half`; the loss sums each
    float output times a weight."""
    graph, arrays, wrt, losses = Graph(name=f"ops_{dtype}"), [], [], []
    b = Builder(graph)
    rng = np.random.default_rng(7)

    def add(array, grad):
        if array.dtype.kind == "f":
            array = array.astype(np_dtype(half)).astype(np_dtype(dtype))
        arrays.append(array)
        wrt.append(grad)
        return graph.add_input(TensorType(dtype_name(array.dtype), array.shape))

    for index, sample in enumerate(samples):
        for name, array in sample.constants("f32").items():
            graph.constants[f"{name}_{index}"] = array.astype(np_dtype(half)).astype(
                np_dtype(dtype)
            )
        floats = sample.float_inputs("f32")
        inputs = [add(a, i in floats) for i, a in enumerate(sample.inputs("f32"))]
        attrs = _attrs(sample, dtype if sample.op not in DRAWS_BY_DTYPE else half)
        if sample.op == "const":
            attrs = {**attrs, "name": f"{attrs['name']}_{index}"}
        node = b.emit(sample.op, *inputs, **attrs)
        if is_float(node.dtype):
            node = b.astype(node, dtype=dtype)
            weight = add(rng.standard_normal(node.shape), False)
            losses.append(b.sum(b.mul(node, weight), axes=tuple(range(len(node.shape)))))
        graph.outputs.append(node)
    total = losses[0]
    for loss in losses[1:]:
        total = b.add(total, loss)
    graph.outputs.insert(0, total)
    return graph, arrays, wrt


def ulps_apart(got, expected, half: str) -> float:
    """The largest distance between got and expected in units of the 16-bit spacing at the
    expected value (the smallest normal's below it); inf where a non-finite value differs."""
    g64, e64 = got.astype(np.float64), expected.astype(np.float64)
    finite = np.isfinite(e64)
    if not np.array_equal(g64[~finite], e64[~finite], equal_nan=True):
        return float("inf")
    if not np.all(np.isfinite(g64[finite])):
        return float("inf")
    info = ml_dtypes.finfo(np_dtype(half))
    magnitude = np.maximum(np.abs(e64[finite]), float(info.smallest_normal))
    spacing = np.exp2(np.floor(np.log2(magnitude)) - info.nmant)
    return float(np.max(np.abs(g64[finite] - e64[finite]) / spacing, initial=0.0))


def _check(got, expected, half: str, names) -> None:
    for name, g, e in zip(names, got, expected, strict=False):
        assert g.shape == e.shape, name
        if not is_float(dtype_name(e.dtype)):
            np.testing.assert_array_equal(g, e, err_msg=name)
            continue
        e64, g64 = e.astype(np.float64), g.astype(np.float64)
        scale = max(1.0, float(np.max(np.abs(e64[np.isfinite(e64)]), initial=0)))
        np.testing.assert_allclose(g64, e64, rtol=TOL[half], atol=TOL[half] * scale, err_msg=name)


@pytest.mark.parametrize("start", range(0, len(_samples()), BATCH))
@pytest.mark.parametrize("half", ["bf16", "f16"])
def test_every_op_sample_in_16_bits_on_both_executors(half, start, monkeypatch):
    """One joint plan per batch of samples (a test each, so the suite's workers share them).
    The driver runs as Python, as a first call does by default: each loop's address form
    (`kernel_at` / `kernel_at_small`, loads and stores written per dtype by
    codegen/render/address_loops.py), all compiled in one module (codegen/build/loop_batch.py).
    A compiled driver instead inlines every loop's view form (`kernel`) into one function of
    ~100 calls: 2.6x the CPU (f16 batch 40, empty cache: 80 against 30 s; about 5 s a batch
    once the library is compiled). The view form's 16-bit loads and stores, which do not depend
    on the op, stay checked with compiled drivers in test_half_compiled.py (chains, reductions,
    matmuls, gradients, layer norm) and every op's view form in test_codegen.py (f64)."""
    monkeypatch.setenv("BACKPLAN_DRIVER", "python")
    batch = _samples()[start : start + BATCH]
    graph, arrays, wrt = _graph(batch, half, half)
    plan = build_joint_plan(graph, wrt)
    eager = run_plan(plan, list(arrays))  # every op's result rounded
    lowered = lower(plan)
    reference = run_plan(lowered.interpreted, list(arrays))  # rounded where the loops store
    compiled = CompiledPlan(lowered)(list(arrays))
    wide, wide_arrays, _ = _graph(batch, "f64", half)
    expected = run_plan(build_joint_plan(wide, wrt), list(wide_arrays))
    names = ["loss"] + [s.id for s in batch] + [f"grad {i}" for i in range(len(reference))]
    for result in (eager, reference, compiled):
        for r in result:
            assert not is_float(dtype_name(r.dtype)) or r.dtype == np_dtype(half)
        _check(result, expected, half, names)
    apart = {
        name: ulps_apart(c, r, half)
        for name, c, r in zip(names, compiled, reference, strict=False)
        if is_float(dtype_name(r.dtype))
    }
    wider = {name: u for name, u in apart.items() if u > ULPS_APART}
    assert not wider, f"compiled and reference {half} results apart by (ulps): {wider}"


assert ml_dtypes  # bfloat16's dtype is registered with NumPy
