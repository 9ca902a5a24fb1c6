"""The step profile (bench/step_profile.py) times the plan's own driver: readings only before
calls by name and at the end, the IR lines each call computes, GEMM sizes read from the call,
and the profiled driver's results equal to the plan driver's, bit for bit."""

import numpy as np

from backplan.bench import step_profile
from backplan.runtime.backend import use_backend

SOURCE = """import numpy as np

def run(v0, v1, scratch):
    # %2 = matmul %0, %1 : f32[4,3]
    # %3 = relu %2 : f32[4,3]
    v0_1d = v0.reshape(-1)
    own_gemm_at(512, np.bool_(False), np.bool_(False), np.intp(4), np.intp(3), np.intp(5), v0_1d)
    k_abc(scratch, np.intp(0))
    # %4 = cross_entropy %3, %1 : f32[]
    v4 = scratch[0:12].reshape((4, 3))
    bad = rows(v4)
    if bad != -1:
        raise IndexError('bad', bad)
    gemm_at_f32(np.bool_(True), np.bool_(False), np.intp(2), np.intp(7), np.intp(9), v1)
    return v4
"""


def test_readings_before_each_call_by_name_and_at_the_end():
    source, calls = step_profile.timed_source(SOURCE)
    assert [c.statement.split("(")[0] for c in calls] == [
        "own_gemm_at", "k_abc", "bad = rows", "gemm_at_f32",
    ]  # fmt: skip
    assert calls[0].ir_lines == ("%2 = matmul %0, %1 : f32[4,3]", "%3 = relu %2 : f32[4,3]")
    assert calls[1].ir_lines == ()
    assert calls[2].ir_lines == ("%4 = cross_entropy %3, %1 : f32[]",)
    assert [c.flops for c in calls] == [2 * 4 * 3 * 5, 0, 0, 2 * 2 * 7 * 9]
    lines = [x.strip() for x in source.splitlines()]
    assert lines[0] == f"def run(v0, v1, scratch, {step_profile.STAMPS}):"
    stamps = [i for i, x in enumerate(lines) if x.startswith(f"{step_profile.STAMPS}[")]
    assert [lines[i] for i in stamps] == [f"_ts[{j}] = _cycles()" for j in range(5)]
    assert [lines[i + 1].split("(")[0] for i in stamps] == [
        "own_gemm_at", "k_abc", "bad = rows", "gemm_at_f32", "return v4",
    ]  # fmt: skip
    assert lines[1] == "v0_1d = v0.reshape(-1)"  # views are not timed on their own


def test_profiled_driver_computes_what_the_plans_driver_computes():
    from backplan.bench.models import value_and_grad_step

    with use_backend("numba"):
        step, args = value_and_grad_step("mlp_tiny")
        for _ in range(2):
            step(*args)
        plan, arrays = step_profile.captured_arguments(step, args)
    driver, calls = step_profile.profiled_driver(plan)
    assert len(calls) >= 6  # three layers: products and their fused loops
    assert sum(c.flops for c in calls) > 0 or any("matmul" in " ".join(c.ir_lines) for c in calls)

    import ast

    run = next(n for n in ast.parse(plan.source).body if getattr(n, "name", "") == "run")
    names = [a.arg for a in run.args.args]
    first_scratch = next(i for i, n in enumerate(names) if n.startswith("scratch"))

    def fresh():
        """The captured arrays, with scratch and outputs (the driver's arguments from the
        first scratch buffer on) overwritten with NaN: both drivers must write them again."""
        copies = [a.copy() if isinstance(a, np.ndarray) else a for a in arrays]
        for i in range(first_scratch, len(names)):
            if copies[i].dtype.kind == "f":
                copies[i][...] = np.nan
        return copies

    plain, profiled = fresh(), fresh()
    plan._compiled_run(*plain)
    readings = np.zeros(len(calls) + 1, np.int64)
    driver(*profiled, readings)
    for name, before, after in zip(names, plain, profiled, strict=True):
        assert np.array_equal(before, after, equal_nan=True), name
    pairs = list(zip(names, profiled, strict=True))[first_scratch:]
    outputs = [a for n, a in pairs if not n.startswith("scratch")]
    assert outputs and all(np.all(np.isfinite(a)) for a in outputs)  # written, not left NaN
    assert np.all(np.diff(readings) >= 0) and readings[0] > 0
