"""A lowered plan's kernels share one empty list (ir/fusion.py NONE_HELD) for the recomputed
values and reduction tails they do not have, where each kernel had two lists of its own: on a
10,086-node plan ~15,500 of the ~33,000 objects its lowering kept alive, each one tracked by
the cyclic collector for as long as the plan lives. Only loops take either, while grouped."""

from __future__ import annotations

import numpy as np
import pytest

import backplan as bp
from backplan.ir.fusion import NONE_HELD
from backplan.ir.lowering import lower


def step(w, x):
    h = bp.tanh(x @ w)
    h = h * bp.sum(h, axis=1, keepdims=True)
    return bp.tanh(h.reshape((4, 8, 8)) @ w).sum()


def lowered_kernels():
    w = np.full((8, 8), 0.1, np.float32)
    x = np.linspace(-1.0, 1.0, 256, dtype=np.float32).reshape(32, 8)
    planner = bp.value_and_grad(step).trace(w, x).planner
    calls = planner.build().peak_calls()
    return [k for c in calls for k in lower(c.plan, c.private_saved).kernels]


def test_kernels_without_recomputed_values_or_reductions_share_the_one_empty_list():
    kernels = lowered_kernels()
    kinds = {k.kind for k in kernels}
    assert {"loop", "op"} <= kinds and len(kinds) >= 3  # loops, GEMMs and views or aliases
    for kernel in kernels:
        assert kernel.recomputed or kernel.recomputed is NONE_HELD
        assert kernel.reductions or kernel.reductions is NONE_HELD
    own = {id(k.recomputed) for k in kernels} | {id(k.reductions) for k in kernels}
    with_own = sum(bool(k.recomputed) for k in kernels) + sum(bool(k.reductions) for k in kernels)
    assert any(k.reductions for k in kernels)  # the row sum's loop keeps its own list
    assert len(own) == with_own + 1  # the shared one, then one per list with something in it
    assert len(NONE_HELD) == 0


def test_adding_to_the_shared_empty_list_is_refused_and_reading_it_is_a_list():
    value = lowered_kernels()[0].nodes[0]
    for add in (
        lambda: NONE_HELD.append(value),
        lambda: NONE_HELD.extend([value]),
        lambda: NONE_HELD.insert(0, value),
    ):
        with pytest.raises(TypeError, match="not a loop has no recomputed values"):
            add()
    held = NONE_HELD
    with pytest.raises(TypeError):
        held += [value]
    assert len(NONE_HELD) == 0
    assert [value] + NONE_HELD == [value] and NONE_HELD == [] and value not in NONE_HELD
