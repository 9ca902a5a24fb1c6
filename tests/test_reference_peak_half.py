"""On the reference interpreter, the peak explain prints for a plan with 16-bit values is what
the interpreter holds: it runs the plan widened (float32 values between roundings, each held
until the op that rounds it reads it: ir/widen.py, ir/rounding_points.py), and explain counts
that plan, not the one before widening. Counted by the checked mode call for call: bfloat16
and float16 steps, bfloat16 saved buffers of a float32 step, compile + backward,
value_and_grad, a donated training step, bench models in bfloat16, and the plans a
max_peak_bytes budget and memory_frontier choose."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_half_ops import _graph, _samples
from test_memory_while_building import failing_build  # noqa: F401 (a fixture)

import backplan as bp
from backplan.bench.memory_calls import counted_calls, donated_calls, model_arrays, printed_calls
from backplan.bench.models import MODELS
from backplan.bench.peers.backplan_peer import bench_function
from backplan.codegen.build import driver_builder
from backplan.codegen.run.memory_check import checked_memory, measure
from backplan.ir.lowering import lower
from backplan.ir.peak import joint_calls, predicted_peak
from backplan.ir.pipeline import build_joint_plan
from backplan.runtime.backend import interpret, use_backend

CALLS = 3
DTYPES = {"bf16": "bfloat16", "f16": "float16"}


def _printed_and_counted(make) -> tuple[list[int], list[int]]:
    with use_backend("reference"), checked_memory():
        step, report = make()
        counted = counted_calls(step, CALLS)
    return printed_calls(report, CALLS), counted


def _vg(name, dtype, **options):
    def make():
        params, batch = model_arrays(name, dtype=dtype)
        fn = bp.value_and_grad(bench_function(MODELS[name]), **options)
        return (lambda: fn(params, *batch)), bp.explain(fn, params, *batch)

    return make


def _compiled_backward(name, dtype, **options):
    def make():
        params, batch = model_arrays(name, requires_grad=True, dtype=dtype)
        loss = bp.compile(bench_function(MODELS[name]), background=False, **options)
        report = bp.explain(loss, params, *batch)

        def step():
            bp.zero_grad(params)
            loss(params, *batch).backward()

        return step, report

    return make


def _train(name, dtype):
    def make():
        params, batch = model_arrays(name, dtype=dtype)
        opt = bp.optim.adam(1e-3, master_dtype=bp.float32)
        vg = bp.value_and_grad(bench_function(MODELS[name]))

        @bp.compile(donate_argnums=(0, 1), background=False)
        def train(params, state, *batch):
            value, grads = vg(params, *batch)
            params, state = opt.update(grads, state, params)
            return params, state, value

        return donated_calls(train, [params, opt.init(params), *batch])

    return make


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("name", ["mlp", "ln_gelu", "transformer"])
def test_value_and_grad_in_16_bits_prints_what_it_holds(name, dtype):
    printed, counted = _printed_and_counted(_vg(name, DTYPES[dtype]))
    assert printed == counted


@pytest.mark.parametrize("name", ["mlp", "ln_gelu"])
def test_compile_and_backward_in_bfloat16_prints_what_it_holds(name):
    printed, counted = _printed_and_counted(_compiled_backward(name, "bfloat16"))
    assert printed == counted


def test_bfloat16_saved_buffers_of_a_float32_step_print_what_they_hold():
    make = _compiled_backward("ln_gelu", "float32", saved_dtype=bp.bfloat16)
    printed, counted = _printed_and_counted(make)
    assert printed == counted


def test_a_bfloat16_training_step_prints_what_it_holds():
    printed, counted = _printed_and_counted(_train("mlp", "bfloat16"))
    assert printed == counted


def test_budgets_and_frontier_rows_in_bfloat16_hold_what_they_print():
    """Every memory_frontier row's peak is what the plan a budget of exactly that many bytes
    picks holds when it runs; that plan fits the budget (the rows are built, not simulated
    on the plan before widening, which undercounted them)."""
    name, dtype = "transformer", "bfloat16"
    with use_backend("reference"):
        params, batch = model_arrays(name, dtype=dtype)
        frontier = bp.value_and_grad(bench_function(MODELS[name])).memory_frontier(params, *batch)
    rows = [p.peak_bytes for p in frontier.points]
    assert len(rows) > 1
    for budget in rows:
        printed, counted = _printed_and_counted(_vg(name, dtype, max_peak_bytes=budget))
        assert printed == counted
        # the budget bounds the loop's peak, the arrays passed in included
        with use_backend("reference"):
            fn = bp.value_and_grad(bench_function(MODELS[name]), max_peak_bytes=budget)
            report = bp.explain(fn, params, *batch)
        assert report.peak_bytes <= budget


def _op_plan_peaks(samples, half: str) -> tuple[int, int] | None:
    """(printed, counted) allocated peak of the samples' ops in one joint plan of `half`
    values (test_half_ops' graph) run as the reference backend runs it, or None where no op
    has a float output to differentiate."""
    try:
        graph, arrays, wrt = _graph(samples, half, half)[:3]
    except IndexError:
        return None
    plan = build_joint_plan(graph, wrt)
    runs = lower(plan).interpreted or plan
    with checked_memory():
        interpret(runs, list(arrays))
        with measure() as measured:
            interpret(runs, list(arrays))
    calls = joint_calls(plan, len(graph.outputs))
    return predicted_peak(calls, "reference").allocated_peak_bytes, measured.peak


@pytest.mark.parametrize("half", ["bf16", "f16"])
def test_every_registry_op_in_16_bits_prints_what_the_reference_holds(half):
    """Each op sample alone, forward and backward (74 of the 88 bf16 samples printed another
    peak than the interpreter held before)."""
    differ = {}
    for sample in _samples():
        peaks = _op_plan_peaks([sample], half)
        if peaks is not None and peaks[0] != peaks[1]:
            differ[sample.id] = peaks
    assert not differ


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    indices=st.lists(st.integers(0, len(_samples()) - 1), min_size=2, max_size=6, unique=True),
    half=st.sampled_from(["bf16", "f16"]),
)
def test_registry_ops_together_in_16_bits_print_what_the_reference_holds(indices, half):
    """A few samples in one plan: values of one op held while another's run, loops sharing
    rounding points."""
    samples = _samples()
    peaks = _op_plan_peaks([samples[i] for i in indices], half)
    if peaks is not None:
        assert peaks[0] == peaks[1], [samples[i].id for i in indices]


@pytest.mark.usefixtures("child_builds", "failing_build")
def test_calls_while_a_bfloat16_step_builds_hold_the_printed_building_peak():
    """background=True: the first calls run the widened plan on the reference interpreter
    beside the compiled plans' arenas (test_memory_while_building's float32 twin); the build
    fails so the calls stay there however fast the machine is."""

    def loss(w, x):
        return bp.mean(bp.tanh(bp.gelu(x @ w) * 1.5) ** 2)

    rng = np.random.default_rng(3)
    w = bp.tensor(rng.standard_normal((6, 5)).astype(ml_dtypes.bfloat16))
    x = bp.tensor(rng.standard_normal((11, 6)).astype(ml_dtypes.bfloat16))
    with use_backend("numba"), checked_memory():
        fn = bp.value_and_grad(loss, background=True)
        report = bp.explain(fn, w, x)
        with pytest.warns(bp.DriverBuildWarning, match="keep running on the reference"):
            fn(w, x)
            fn.wait_until_compiled(timeout=60)
            assert fn.driver_tier == "reference"
            counted = counted_calls(lambda: fn(w, x), 3)
            assert driver_builder.wait_for_builds(timeout=60)
    assert counted == [report.building_peak_on_call(n).allocated_peak_bytes for n in (2, 3, 4)]
