"""What a budget made the step run, in explain's summary: the values recomputed and the FLOPs
they add (a value_and_grad's too, not only a training step's inlined gradients), and, where the
budget was met by recomputing in full precision, what allow_saved_dtype=bp.bfloat16 would run
for the same budget: the FLOPs of the plan such a step does run, with the rounding it costs."""

from __future__ import annotations

import re

import numpy as np
import pytest

import backplan as bp
from backplan.runtime.backend import use_backend


def loss(p, x, y):
    h = x
    for i in range(8):
        h = bp.tanh(h @ p[f"w{i}"])
    return bp.mse_loss(h, y)


def arrays():
    rng = np.random.default_rng(0)
    p = {f"w{i}": (rng.standard_normal((32, 32)) * 0.3).astype(np.float32) for i in range(8)}
    x = rng.standard_normal((512, 32)).astype(np.float32)
    return p, x, rng.standard_normal((512, 32)).astype(np.float32)


def summary(step) -> str:
    return " ".join(step.explain(*arrays()).saved_dtype_note.split())


def added_flops(step) -> int:
    """The FLOPs the plan a step runs adds, from its planner's choice (0: nothing recomputed)."""
    chosen = step.trace(*arrays()).planner.recomputed_for
    return chosen[1].added_flops if chosen else 0


@pytest.mark.parametrize("backend", ["numba", "reference"])
def test_a_value_and_grad_budget_says_what_it_recomputes_and_what_bfloat16_would_cost(backend):
    with use_backend(backend):
        frontier = bp.value_and_grad(loss).memory_frontier(*arrays())
        assert len(frontier.points) >= 2
        row = frontier.points[-1]
        budget = row.peak_bytes
        step = bp.value_and_grad(loss, max_peak_bytes=budget)
        text = summary(step)
        share = f"+{100 * row.added_flops / frontier.step_flops:.1f}% of the step"
        assert (
            f"To fit max_peak_bytes={budget:,}, the step recomputes {row.recomputed} of the "
            f"values its backward reads instead of holding them" in text
        )  # before, a value_and_grad's summary said nothing of its budget
        assert f"for {row.added_flops:,} added FLOPs ({share})" in text
        allowed = bp.value_and_grad(loss, max_peak_bytes=budget, allow_saved_dtype=bp.bfloat16)
        flops = added_flops(allowed)
        assert flops < row.added_flops
        offer = re.search(r"allow_saved_dtype=bp.bfloat16 would fit it (.*?), the saved", text)
        assert offer is not None, text
        if flops:
            assert offer.group(1).startswith(f"for {flops:,} added FLOPs")
        else:
            assert offer.group(1) == "with no added FLOPs (nothing recomputed)"
        assert "rounded to 8 significant bits (each within 2^-8, 0.39%" in text
        # the step allowed it runs a plan in bfloat16 and says so, offering nothing more
        assert "kept in bfloat16" in summary(allowed)
        assert "would fit it" not in summary(allowed)


def test_a_budget_the_default_plan_meets_says_nothing_of_recomputing():
    frontier = bp.value_and_grad(loss).memory_frontier(*arrays())
    step = bp.value_and_grad(loss, max_peak_bytes=frontier.points[0].peak_bytes)
    assert "To fit" not in summary(step) and "would fit it" not in summary(step)


def test_saved_bytes_budget_of_a_compiled_step_offers_bfloat16_with_what_it_runs():
    """saved_bytes_budget, a compiled step whose gradients are an inlined value_and_grad."""

    def step_with(**options):
        return bp.compile(lambda p, x, y: bp.value_and_grad(loss)(p, x, y), **options)

    held = step_with().trace(*arrays()).planner.choices.schedule.held_bytes()
    budget = held * 2 // 3
    text = summary(step_with(saved_bytes_budget=budget))
    assert f"To fit saved_bytes_budget={budget:,}, the step recomputes" in text
    assert "values its inlined gradients read" in text
    allowed = step_with(saved_bytes_budget=budget, allow_saved_dtype=bp.bfloat16)
    assert added_flops(allowed) == 0  # half the bytes in bfloat16: nothing recomputed
    assert "allow_saved_dtype=bp.bfloat16 would fit it with no added FLOPs" in text


def test_a_refusal_says_whether_bfloat16_saved_buffers_would_fit_the_budget():
    """Under the full-precision floor but within what bfloat16 saved buffers reach: the refusal
    says that allow_saved_dtype=bp.bfloat16 fits it, for the FLOPs the allowed step then adds
    (before, it said only that the option exists)."""
    allowed = bp.value_and_grad(loss, allow_saved_dtype=bp.bfloat16).memory_frontier(*arrays())
    full = bp.value_and_grad(loss).memory_frontier(*arrays())
    floor = (full.floor or full.points[-1]).peak_bytes
    lowest = min(p.peak_bytes for p in allowed.points + [allowed.floor] if p is not None)
    assert lowest < floor - 1
    budget = floor - 1
    with pytest.raises(bp.MemoryBudgetError) as refused:
        bp.value_and_grad(loss, max_peak_bytes=budget).trace(*arrays())
    words = " ".join(str(refused.value).split())
    step = bp.value_and_grad(loss, max_peak_bytes=budget, allow_saved_dtype=bp.bfloat16)
    flops = added_flops(step)
    cost = f"for {flops:,} added FLOPs" if flops else "with no added FLOPs (nothing recomputed)"
    assert f"allow_saved_dtype=bp.bfloat16 fits it: {cost}" in words, words
    assert "rounded to 8 significant bits" in words
    # max_batch's probes refuse without weighing it, and find the same batch as before
    assert bp.max_batch(bp.value_and_grad(loss), arrays(), max_peak_bytes=budget) >= 1


def test_a_refused_saved_bytes_budget_says_whether_bfloat16_saved_buffers_meet_it():
    """A saved_bytes_budget under the fewest saved bytes any plan keeps: the refusal says what
    allow_saved_dtype=bp.bfloat16 does with the same budget (before: nothing), and that is
    what the step allowed it does. With bfloat16 allowed, plans saving less than every
    full-precision one are offered, though the narrowed chain ends above them (a narrowed plan
    peaking lower than any saving less: before, the full-precision chain's end followed it)."""

    def step_with(**options):
        return bp.compile(lambda p, x, y: bp.value_and_grad(loss)(p, x, y), **options)

    def refusal(budget, **options) -> str:
        with pytest.raises(bp.MemoryBudgetError) as refused:
            step_with(saved_bytes_budget=budget, **options).trace(*arrays())
        return " ".join(str(refused.value).split())

    def fewest(**options) -> int:
        found = re.search(r"keeps without a higher peak is ([\d,]+)", refusal(1, **options))
        return int(found.group(1).replace(",", ""))

    full, narrowed = fewest(), fewest(allow_saved_dtype=bp.bfloat16)
    assert narrowed < full
    words = refusal(narrowed - 1)
    assert "allow_saved_dtype=bp.bfloat16 (saved buffers in bfloat16) does not meet it" in words
    words = refusal(narrowed - 1, allow_saved_dtype=bp.bfloat16)
    assert "allow_saved_dtype=bp.bfloat16" not in words.split("cannot be met")[1]
    budget = full - 1  # refused in full precision, met by bfloat16 saved buffers
    assert "allow_saved_dtype=bp.bfloat16 meets it" in refusal(budget)
    step_with(saved_bytes_budget=budget, allow_saved_dtype=bp.bfloat16).trace(*arrays())
    # a budget the bfloat16 plans meet says for what
    met = step_with(saved_bytes_budget=budget * 2, allow_saved_dtype=bp.bfloat16)
    met.trace(*arrays())
    text = summary(step_with(saved_bytes_budget=budget * 2))
    assert "allow_saved_dtype=bp.bfloat16 would fit it" in text


def test_a_refused_saved_bytes_budget_says_what_bfloat16_saved_buffers_meet_it_with():
    """mlp_deep's training step on numba keeps at least 796,672 saved bytes in full precision
    and 655,360 with bfloat16 saved buffers: a budget between is refused, the refusal saying
    what the step allowed bfloat16 runs for it."""
    from backplan.bench.budget_models import mlp_deep

    fn, params, batch = mlp_deep()

    def step_with(**options):
        return bp.compile(lambda p, x, y: bp.value_and_grad(fn)(p, x, y), **options)

    budget = 700_000
    with use_backend("numba"):
        with pytest.raises(bp.MemoryBudgetError) as refused:
            step_with(saved_bytes_budget=budget).trace(params, *batch)
        allowed = step_with(saved_bytes_budget=budget, allow_saved_dtype=bp.bfloat16)
        chosen = allowed.trace(params, *batch).planner.recomputed_for
    words = " ".join(str(refused.value).split())
    flops = chosen[1].added_flops if chosen else 0
    cost = f"for {flops:,} added FLOPs" if flops else "with no added FLOPs (nothing recomputed)"
    assert f"allow_saved_dtype=bp.bfloat16 meets it: {cost}" in words, words
    assert "rounded to 8 significant bits" in words
