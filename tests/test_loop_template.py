"""A loop kernel's lines taken from another size of the same symbolic plan
(codegen/render/loop_template.py) are the lines a fresh rendering writes: every size of the bench
transformer, LSTM and CNN, in float32 and bfloat16, renders the same module, lifted literals
and loop kernels (source, digest, arguments) with the templates of the sizes before as with
none; and later sizes do take their loops' lines from the templates."""

import pytest
from helpers import bench_symbolic_plan, written_module
from hypothesis import given, settings
from hypothesis import strategies as st

from backplan.codegen.render import emit, loops, substitution
from backplan.codegen.render.choices import pinned
from backplan.ir import lowering

# the LSTM at its small sizes (2 steps, 4 hidden): its 12 steps at 8 rows lower for ~0.3 s a size
CASES = [
    (m, d, small)
    for m, small in (("transformer", False), ("lstm12", True), ("cnn", False))
    for d in ("float32", "bfloat16")
]


_fitted = bench_symbolic_plan


@pytest.fixture(scope="module", params=CASES, ids=[f"{m}-{d}" for m, d, _ in CASES])
def symbolic(request):
    return _fitted(*request.param)


def _rendered(lowered, templates):
    """The plan's module rendered with this template store (an empty one: afresh), the
    size-dependent choices pinned as every size of the plan renders them."""
    shared = lowered.plan.shared
    kept = shared.get("loop_templates")
    shared["loop_templates"] = templates
    try:
        with pinned(shared.setdefault("choices", {})):
            return emit._generate(lowered, True)
    finally:
        shared["loop_templates"] = kept if kept is not None else templates


_written = written_module


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40))  # 0: a mean over the batch has no 1/n (0 is traced apart)
def test_a_size_rendered_from_templates_equals_its_fresh_rendering(symbolic, n):
    lowered = lowering.lower(symbolic.at(n)[0])
    store = lowered.plan.shared.setdefault("loop_templates", {})
    assert _written(_rendered(lowered, store)) == _written(_rendered(lowered, {}))


def test_later_sizes_take_their_loops_from_the_templates(monkeypatch):
    symbolic = _fitted("transformer", "float32")
    at_12 = lowering.lower(symbolic.at(12)[0])
    monkeypatch.setitem(at_12.plan.shared, "loop_templates", {})  # none kept yet
    # sizes rendered, not substituted from a recipe (codegen/render/substitution.py)
    monkeypatch.setitem(at_12.plan.shared, "recipes", [])
    monkeypatch.setattr(substitution, "RECIPES_KEPT", 0)
    fresh, taken = [], []
    real_views = loops.LoopEmitter._views
    real_arguments = loops.LoopEmitter._arguments

    def views(self):
        fresh.append(1)
        return real_views(self)

    def arguments(self):
        taken.append(1)
        return real_arguments(self)

    monkeypatch.setattr(loops.LoopEmitter, "_views", views)
    monkeypatch.setattr(loops.LoopEmitter, "_arguments", arguments)
    emit.generate(at_12)
    first = len(fresh)
    assert first > 10  # the size's loops, rendered
    emit.generate(lowering.lower(symbolic.at(13)[0]))
    emit.generate(lowering.lower(symbolic.at(15)[0]))
    assert len(fresh) - first < first // 4  # most loops of 13 and 15 from 12's lines
    assert len(taken) - len(fresh) > first
