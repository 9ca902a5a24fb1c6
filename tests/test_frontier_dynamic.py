"""memory_frontier at a size of a dynamic axis: the size's calls run the plans fitted over every
size, which offer no budget, so the frontier plans that size alone, as a budget (which keeps
dynamic axes off) plans it. It raised AttributeError ('NoneType' object has no attribute
'memory_frontier') at every size but the first an axis was seen at."""

from __future__ import annotations

import numpy as np
import pytest

import backplan as bp


def tanh_loss(w, x):
    return bp.mean(bp.tanh(bp.tanh(x @ w) @ w) ** 2)


def rows(frontier) -> list[tuple[int, int]]:
    return [(p.peak_bytes, p.added_flops) for p in frontier.points]


@pytest.fixture
def arrays():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 16)).astype(np.float32) * 0.3
    return w, rng.standard_normal((32, 16)).astype(np.float32)


@pytest.mark.parametrize("kind", ["value_and_grad", "compile"])
def test_a_learned_dynamic_axis_lists_the_frontier_of_the_size_asked(arrays, kind):
    w, x = arrays
    if kind == "compile":
        make = lambda **options: bp.compile(tanh_loss, **options)  # noqa: E731
        w = bp.tensor(w, requires_grad=True)
    else:
        make = lambda **options: bp.value_and_grad(tanh_loss, **options)  # noqa: E731
    fn = make()
    fn(w, x)
    fn(w, x[:8])  # the batch axis is dynamic from the second size seen
    for n in (8, 32, 5):
        got = fn.memory_frontier(w, x[:n])
        alone = make().memory_frontier(w, x[:n])  # a function that saw this size only
        assert rows(got) == rows(alone), n
        for peak, _ in rows(got):  # each row's peak, as a budget, runs a plan that fits it
            assert make(max_peak_bytes=peak).explain(w, x[:n]).peak_bytes <= peak, (n, peak)


def test_a_declared_dynamic_axis_lists_the_frontier_of_every_size(arrays):
    w, x = arrays
    fn = bp.compile(tanh_loss, dynamic={"x": {0: "batch"}})
    first = fn.memory_frontier(w, x)
    later = fn.memory_frontier(w, x[:8])
    assert rows(first) == rows(bp.compile(tanh_loss).memory_frontier(w, x))
    assert rows(later) == rows(bp.compile(tanh_loss).memory_frontier(w, x[:8]))
    assert later.points[0].peak_bytes < first.points[0].peak_bytes
