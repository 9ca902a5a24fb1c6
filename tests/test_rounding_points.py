"""Where 16-bit results are rounded (ir/rounding_points.py): a compiled fused loop keeps a chain
in float32 and rounds what it stores, and the reference interpreter running the lowered plan
(the reference backend, and the calls a background build leaves to it) rounds at the same
points, so the two agree bit for bit where their float32 arithmetic does. A plan interpreted
before lowering rounds every op's result (PyTorch eager, jax.jit on the CPU)."""

from __future__ import annotations

import sys
import weakref

import ml_dtypes
import numpy as np
import pytest
from test_half_ops import ulps_apart

import backplan as bp
from backplan.bench.models import MODELS, ln_gelu
from backplan.ir.builder import Builder
from backplan.ir.fusion import Kernel
from backplan.ir.graph import Graph
from backplan.ir.interpreter import run_plan
from backplan.ir.liveness import plan_liveness
from backplan.ir.lowering import lower
from backplan.ir.rounding_points import (
    RoundingPoints,
    Widened,
    reference_plan,
    rounding_points,
)
from backplan.ir.types import TensorType
from backplan.ir.widen import widen
from backplan.runtime.backend import use_backend

DTYPES = {"bf16": ml_dtypes.bfloat16, "f16": np.float16}


def chain(x, w):
    """Four fused ops: rounding each op's result moves about a third of the results."""
    return (bp.exp(x * w) + w) * x


def _inputs(name: str, n: int = 4099):  # odd: a vector loop's tail too
    rng = np.random.default_rng(11)
    x = rng.uniform(-2, 2, n).astype(DTYPES[name])
    w = rng.uniform(-2, 2, n).astype(DTYPES[name])
    x[:3] = np.inf, -np.inf, np.nan
    return x, w


def _bits(array) -> np.ndarray:
    return np.asarray(array).view(np.uint16)


@pytest.mark.parametrize("name", DTYPES)
def test_compiled_chain_and_reference_backend_round_at_the_same_points(name):
    x, w = _inputs(name)
    with use_backend("numba"):
        compiled = bp.compile(chain)(x, w).numpy()
    with use_backend("reference"):
        reference = bp.compile(chain)(x, w).numpy()
    f32 = [a.astype(np.float32) for a in (x, w)]
    with np.errstate(all="ignore"):
        once = ((np.exp(f32[0] * f32[1]) + f32[1]) * f32[0]).astype(DTYPES[name])
    np.testing.assert_array_equal(_bits(reference), _bits(once))
    nan = np.isnan(once.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(compiled.astype(np.float32)), nan)
    apart = np.abs(_bits(compiled)[~nan].astype(np.int32) - _bits(once)[~nan].astype(np.int32))
    assert apart.max() <= 1  # Numba's exp against NumPy's: a float32 last bit, then rounded
    assert (apart == 0).mean() > 0.99

    plan = bp.compile(chain).trace(x, w).program.plans.forward  # not lowered: every op rounds
    eager = run_plan(plan, [x, w])[0]
    assert (_bits(eager) != _bits(once)).mean() > 0.1  # what rounding each op changes


@pytest.mark.parametrize("name", DTYPES)
def test_softmax_gradient_in_16_bits_equals_the_reference_backend(name):
    """logsumexp's and softmax's gradients subtract nearly equal values: rounding each op put
    the reference 7-15 ulps from the compiled step (BENCHMARKS 33)."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((33, 70)).astype(DTYPES[name])
    v = rng.standard_normal((33, 70)).astype(DTYPES[name])

    def loss(x, v):
        return bp.sum(bp.softmax(x, axis=-1) * v) + bp.sum(bp.logsumexp(x, axis=-1))

    results = {}
    for backend in ("numba", "reference"):
        with use_backend(backend):
            value, grad = bp.value_and_grad(loss)(x, v)
            results[backend] = (value.numpy(), grad.numpy())
    for got, want in zip(results["numba"], results["reference"], strict=True):
        assert got.dtype == DTYPES[name]
        step = np.abs(_bits(got).astype(np.int32) - _bits(want).astype(np.int32))
        assert step.max() <= 1, step.max()


def test_a_loop_reading_the_stored_value_back_reads_it_rounded():
    """A widening cast one loop takes from the float32 value it computed, and another loop
    recomputes from the 16-bit value it reads back from a buffer: the cast holds the float32
    value, and the other loop's own nodes read the rounded value widened again."""
    graph = Graph(name="two_loops")
    b = Builder(graph)
    x = graph.add_input(TensorType("bf16", (8,)))
    graph.outputs = [b.exp(x)]
    wide = widen(graph)
    up, source, rounded = wide.nodes[0], wide.nodes[1], wide.nodes[2]  # astype, exp, astype
    assert (up.op, source.op, rounded.op) == ("astype", "exp", "astype")
    builder = Builder(wide)
    cast = builder.astype(rounded, dtype="f32")
    twice, again = builder.add(cast, cast), builder.mul(cast, cast)
    home = Kernel("loop", [up, source, rounded, cast, twice], (8,))
    assert rounding_points([home]).held == {cast: source}
    reads_memory = Kernel("loop", [again], (8,), recomputed=[cast])
    points = rounding_points([home, reads_memory])
    assert points.held == {cast: source}
    assert points.reads == {again: {cast: Widened(rounded, "f32")}}


def test_reference_plan_keeps_what_a_loop_reads_until_it_reads_it():
    graph = Graph(name="late_reader")
    b = Builder(graph)
    x = graph.add_input(TensorType("f32", (5,)))
    y = graph.add_input(TensorType("f32", (5,)))
    source = b.mul(x, x)
    rounded = b.astype(source, dtype="bf16")
    later = b.exp(y)  # a step between: the float32 value is freed after the rounding
    cast = b.astype(rounded, dtype="f32")
    graph.outputs = [b.add(cast, later)]
    plan = plan_liveness(graph)
    arrays = [np.linspace(1.01, 1.09, 5, dtype=np.float32), np.zeros(5, np.float32)]
    rounded_each_op = run_plan(plan, list(arrays))[0]
    held = reference_plan(plan, RoundingPoints(held={cast: source}), {})
    kept = run_plan(held, list(arrays))[0]
    np.testing.assert_array_equal(kept, arrays[0] * arrays[0] + 1)
    assert not np.array_equal(rounded_each_op, kept)
    assert plan.unrounded == {}  # the plan given is left as it was


@pytest.mark.parametrize("name", DTYPES)
def test_lowered_plan_tells_the_interpreter_the_roundings_its_loops_skip(name):
    """The chain's loop keeps mul, exp and add in float32: the interpreted plan holds
    their float32 values at the casts; a float32 plan has nothing to tell."""
    x, w = _inputs(name, 64)
    lowered = lower(bp.compile(chain).trace(x, w).program.plans.forward)
    held = lowered.interpreted.unrounded
    assert sorted(s.op for s in held.values()) == ["add", "exp", "mul"]
    wide = [a.astype(np.float32) for a in (x, w)]
    lowered = lower(bp.compile(chain).trace(*wide).program.plans.forward)
    assert lowered.interpreted.unrounded == {}


@pytest.mark.parametrize("name", DTYPES)
def test_ln_gelu_step_in_16_bits_equals_the_reference_backend(name):
    """The bench's ln_gelu (layer norm, tanh GELU, their gradients) in 16 bits: a row kernel
    rounds and stores a gradient term that its own loop reads in float32 and a later loop
    reads back rounded; each output within one ulp of the reference backend's."""
    spec = MODELS["ln_gelu"]
    data = spec.inputs(True, np.float32)
    params = {k: v.astype(DTYPES[name]) for k, v in data.params.items()}
    batch = [a.astype(DTYPES[name]) if a.dtype.kind == "f" else a for a in data.batch(True)]
    results = {}
    for backend in ("numba", "reference"):
        with use_backend(backend):
            value, grads = bp.value_and_grad(ln_gelu.loss)(params, *batch, **spec.static)
            results[backend] = [value.numpy()] + [g.numpy() for g in grads.values()]
    for got, want in zip(results["numba"], results["reference"], strict=True):
        assert got.dtype == DTYPES[name]
        assert ulps_apart(got, want, name) <= 1.0


@pytest.mark.parametrize("backend", ["numba", "reference"])
def test_explain_names_the_16_bit_results_kept_in_float32(backend):
    x, w = _inputs("bf16", 64)
    with use_backend(backend):
        text = str(bp.explain(bp.compile(chain), x, w))
        wide = str(bp.explain(bp.compile(chain), x.astype(np.float32), w.astype(np.float32)))
    assert "(rounded only where a buffer stores them): f0 mul, f1 exp, f2 add." in text
    assert "16-bit values kept in float32" not in wide


@pytest.mark.filterwarnings("ignore::backplan.DriverBuildWarning")
@pytest.mark.usefixtures("child_builds")
@pytest.mark.parametrize("name", DTYPES)
def test_calls_while_a_background_build_runs_give_the_compiled_bits(name, monkeypatch, tmp_path):
    """bp.compile(..., background=True): the calls made while the kernels build run on the
    reference interpreter (here the build fails, so they all do); they round where the
    compiled plan rounds, so a function's results do not change when its build finishes."""
    from backplan.codegen.build import driver_builder

    monkeypatch.setenv("BACKPLAN_CACHE_DIR", str(tmp_path / "kernels"))
    failing = [sys.executable, "-c", "import sys; sys.exit('no compiler')"]
    monkeypatch.setattr(driver_builder, "_command", lambda: failing)
    x, w = _inputs(name)
    with use_backend("numba"):
        building = bp.compile(chain, background=True)
        first = building(x, w).numpy()
        assert building.driver_tier == "reference"
    monkeypatch.undo()
    with use_backend("numba"):
        compiled = bp.compile(chain)
        compiled(x, w)
        assert compiled.driver_tier != "reference"
        again = compiled(x, w).numpy()
    nan = np.isnan(again.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(first.astype(np.float32)), nan)
    apart = np.abs(_bits(first)[~nan].astype(np.int32) - _bits(again)[~nan].astype(np.int32))
    assert apart.max() <= 1 and (apart == 0).mean() > 0.99


def test_a_value_is_freed_at_its_step_when_the_next_step_reads_a_held_value():
    """The interpreter keeps no reference to a step's inputs past that step: a value freed
    after the step reading it last is gone when the next step, a cast holding a float32
    value, runs (the checked mode counts what is alive)."""
    graph = Graph(name="freed_in_time")
    b = Builder(graph)
    x = graph.add_input(TensorType("f32", (5,)))
    source = b.mul(x, x)
    rounded = b.astype(source, dtype="bf16")
    temporary = b.exp(x)
    last_read = b.neg(temporary)  # temporary's last reader: freed after this step
    cast = b.astype(rounded, dtype="f32")  # the next step
    graph.outputs = [b.add(cast, last_read)]
    plan = reference_plan(plan_liveness(graph), RoundingPoints(held={cast: source}), {})
    steps = {node: index for index, node in enumerate(graph.nodes)}
    seen = {}

    def on_step(step, env):
        if step == steps[temporary]:
            seen["temporary"] = weakref.ref(env[temporary])
        if step == steps[cast]:
            seen["alive"] = seen["temporary"]() is not None

    run_plan(plan, [np.linspace(1, 2, 5, dtype=np.float32)], on_step=on_step)
    assert seen["alive"] is False
