"""A new size of a symbolic plan rendered as a substitution (codegen/render/substitution.py):
the module, lifted literals and loop kernels a recipe gives at a size are the ones a fresh
rendering writes, byte for byte, at every size it applies to (the bench transformer, LSTM, CNN
and MLP, float32 and bfloat16); a size whose guards fail is rendered afresh and recorded; the
steps it runs equal the reference interpreter's."""

import dataclasses
import functools

import numpy as np
import pytest
from helpers import bench_symbolic_plan, written_module
from hypothesis import given, settings
from hypothesis import strategies as st

import backplan as bp
from backplan.bench.batch_sizes import loss_of
from backplan.bench.models import MODELS
from backplan.codegen.build import loop_calls
from backplan.codegen.render import emit, substitution
from backplan.codegen.render.choices import pinned
from backplan.codegen.render.traced_numbers import Traced, Untraceable, recording
from backplan.ir import lowering
from backplan.runtime.backend import use_backend

CASES = [
    (m, d, small)
    for m, small in (("transformer", False), ("lstm12", True), ("cnn", False), ("mlp", False))
    for d in ("float32", "bfloat16")
]


_fitted = bench_symbolic_plan


@functools.cache
def _recipe(name: str, dtype: str, small: bool, at: int):
    """The recipe recorded at size `at` (None where the traced rendering was refused)."""
    lowered = lowering.lower(_fitted(name, dtype, small).at(at)[0])
    fresh = _fresh(lowered)
    choices = lowered.plan.shared.setdefault("choices", {})
    return substitution.recorded(lowered, fresh, choices, [])


def _fresh(lowered):
    """The plan's module rendered afresh (no loop templates), its choices pinned as every
    size of the plan renders them."""
    shared = lowered.plan.shared
    kept = shared.get("loop_templates")
    shared["loop_templates"] = {}
    try:
        with pinned(shared.setdefault("choices", {})):
            return emit._generate(lowered, True)
    finally:
        shared["loop_templates"] = kept if kept is not None else {}


def _written(module, graph) -> tuple:
    position = {v: i for i, v in enumerate(graph.inputs + graph.nodes)}
    return (
        *written_module(module),
        module.driver_parts,
        module.code,
        module.output_sources,
        [position[v] for v in module.output_buffers],
        {i: position[v] for i, v in module.literal_outputs.items()},
        sorted(position[v] for v in module.epilogues_apart),
        sorted((position[v], n) for v, n in module.calls_of.items()),
        sorted((position[v], t) for v, t in module.gemms.items()),
    )


@pytest.fixture(scope="module", params=CASES, ids=[f"{m}-{d}" for m, d, _ in CASES])
def case(request):
    return request.param


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 40))
def test_a_substituted_size_equals_its_fresh_rendering(case, n):
    name, dtype, small = case
    first = 2 if small else 8
    recipe = _recipe(name, dtype, small, first)
    if dtype == "float32":
        assert recipe is not None  # every float32 bench model's rendering is traced
    if recipe is None:
        return
    lowered = lowering.lower(_fitted(*case).at(n)[0])
    applied = substitution.apply(recipe, lowered)
    graph = lowered.plan.graph
    fresh = _fresh(lowered)
    if applied is not None:
        assert _written(applied, graph) == _written(fresh, graph)
    elif dtype == "float32" and n > 1:
        # the float32 models' structure and guards hold at every size but 1 (a unit axis)
        raise AssertionError(f"{name} at {n}: the recipe made at {first} did not apply")


def test_the_recipe_holds_its_guards_and_literals_at_its_own_size():
    recipe = _recipe("transformer", "float32", False, 8)
    lowered = lowering.lower(_fitted("transformer", "float32").at(8)[0])
    numbers, fixed = substitution.leaves(lowered)
    assert recipe.guards(numbers)
    assert len(recipe.guard_texts) > 100  # the rendering's comparisons, recorded
    assert recipe.literals(numbers) == tuple(_fresh(lowered).literals)


def test_a_failed_guard_renders_the_size_afresh_and_records_it(monkeypatch):
    symbolic = _fitted("transformer", "float32")
    shared = symbolic.shared
    recipe = _recipe("transformer", "float32", False, 8)
    failing = dataclasses.replace(recipe, guards=lambda L: False, guard_texts=["False"])
    monkeypatch.setitem(shared, "recipes", [failing])
    monkeypatch.setitem(shared, "recipes refused", [])
    rendered = []
    real = emit._generate

    def counting(lowered, comments=True):
        rendered.append(1)
        return real(lowered, comments)

    monkeypatch.setattr(emit, "_generate", counting)
    lowered = lowering.lower(symbolic.at(13)[0])
    module = emit.generate(lowered)
    assert rendered  # the guard failed: rendered
    monkeypatch.setattr(emit, "_generate", real)
    assert _written(module, lowered.plan.graph) == _written(_fresh(lowered), lowered.plan.graph)
    assert len(shared["recipes"]) == 2  # 13 recorded beside the failing one
    rendered.clear()
    monkeypatch.setattr(emit, "_generate", counting)
    again = lowering.lower(symbolic.at(14)[0])
    emit.generate(again)
    assert not rendered  # 14 from 13's recipe


def test_a_structure_unlike_the_recorded_one_is_rendered():
    recipe = _recipe("transformer", "float32", False, 8)
    lowered = lowering.lower(_fitted("transformer", "float32").at(12)[0])
    other = dataclasses.replace(recipe, key=("another structure",))
    assert substitution.apply(other, lowered) is None
    assert substitution.apply(recipe, lowered) is not None


@pytest.mark.reference
def test_a_recipe_applies_only_where_drivers_call_loops_as_they_did(monkeypatch):
    recipe = _recipe("transformer", "float32", False, 8)
    lowered = lowering.lower(_fitted("transformer", "float32").at(12)[0])
    now = loop_calls.mode()
    monkeypatch.setenv("BACKPLAN_DRIVER_LOOPS", next(m for m in loop_calls.MODES if m != now))
    assert substitution.apply(recipe, lowered) is None


def test_a_refused_tracing_keeps_no_recipe_and_says_why(monkeypatch):
    lowered = lowering.lower(_fitted("mlp", "float32").at(9)[0])
    fresh = _fresh(lowered)

    def refusing(*args, **kwargs):
        raise Untraceable("a traced number with a float32")

    monkeypatch.setattr(emit, "rendered_body", refusing)
    refused: list = []
    assert substitution.recorded(lowered, fresh, {}, refused) is None
    assert refused == ["Untraceable: a traced number with a float32"]


@pytest.mark.parametrize("name", ["mlp"])
def test_substituted_sizes_run_as_the_reference_interpreter(name, monkeypatch):
    applied = []
    real = substitution.apply

    def counting(recipe, lowered):
        found = real(recipe, lowered)
        applied.append(found is not None)
        return found

    monkeypatch.setattr(substitution, "apply", counting)
    monkeypatch.setenv("BACKPLAN_DRIVER", "python")  # the literals the driver reads, uncompiled
    spec = MODELS[name]
    loss, axes = loss_of(spec)
    step = bp.value_and_grad(bp.compile(loss, dynamic=axes))
    reference = bp.value_and_grad(bp.compile(loss, dynamic=axes))
    small = name == "transformer"
    config = spec.small_config if small else spec.config
    for n in (4, 6, 9, 1, 13):
        data = spec.make_inputs({**config, "batch": n}, 1).cast(np.float32)
        args = [{k: bp.tensor(v) for k, v in data.params.items()}]
        args += [bp.tensor(b) for b in data.batch(True)]
        with use_backend("numba"):
            value, grads = step(*args)
        with use_backend("reference"):
            want, want_grads = reference(*args)
        np.testing.assert_allclose(np.asarray(value), np.asarray(want), rtol=2e-5, atol=1e-6)
        assert grads.keys() == want_grads.keys()
        for key in grads:
            np.testing.assert_allclose(
                np.asarray(grads[key]), np.asarray(want_grads[key]), rtol=2e-4, atol=1e-5
            )
    assert sum(applied) >= 2  # 6, 9 and 13 substituted (1 may not be: a unit axis)


def test_a_traced_number_records_what_the_rendering_asks_of_it():
    with recording() as made:
        n = Traced("L[0]", 12)
        m = Traced("L[1]", 128)
        product = n * m + 1
        assert (product.text, product.value) == ("((L[0]*L[1])+1)", 1537)
        assert product > 1000
        assert not (n == 1)
        assert [0, 1, 2][n // 6] == 2  # an index pins the value
        assert hash(n) == hash(m)  # one hash: a lookup compares
        assert {n: 1}.get(m) is None and {n: 1}.get(Traced("L[2]", 12)) == 1
        assert str(product) != str(n)  # each a marker of its own
    L = [12, 128, 12]
    assert all(eval(g, {"L": L}) for g in made.guards)
    L = [13, 128, 12]
    assert not all(eval(g, {"L": L}) for g in made.guards)  # n // 6 and n == L[2] pinned 12
    with recording(), pytest.raises(Untraceable):
        Traced("L[0]", 3) * np.float32(2.0)
