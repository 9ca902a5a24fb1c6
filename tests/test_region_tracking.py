"""runtime/memory.py keeps every recorded region in a table of weak references without
callbacks: live_regions lists only live ones, and the dead are swept as the table grows."""

import gc

import numpy as np

import backplan as bp
from backplan.runtime import memory
from tests.helpers import run_in_threads


def test_live_regions_lists_the_living_and_the_table_stays_bounded():
    f = bp.compile(lambda w, x: (w * x).sum())
    w = bp.tensor(np.ones(3, np.float32), requires_grad=True)
    x = np.arange(3, dtype=np.float32)
    kept = [f(w, x) for _ in range(3)]
    # earlier tests' garbage (regions in cycles) may have been alive at the last sweep, which
    # set the next sweep further out: collect it, then call past that point so a sweep runs
    gc.collect()
    for _ in range(memory._sweep_at + 3000):  # each call's region dies with its output
        f(w, x)
    regions = memory.live_regions()
    assert all(out.grad_fn in regions for out in kept)
    assert len(memory._live_regions) < 2 * max(1024, len(regions)) + 1
    kept[0].backward()  # freed, still alive while its output is

    def ours():
        return [r for r in memory.live_regions() if r.input_edges[0].leaf is w]

    assert len(ours()) == 3
    del kept, regions
    assert ours() == []


def test_regions_made_on_two_threads_while_the_table_is_swept_are_all_listed():
    """track appends without a lock while a sweep may replace the entries it read: a region
    one thread makes during the other's sweep must stay listed."""
    f = bp.compile(lambda w, x: (w * x).sum())
    w = bp.tensor(np.ones(3, np.float32), requires_grad=True)
    x = np.arange(3, dtype=np.float32)
    kept: dict = {0: [], 1: []}
    errors = []

    def worker(key):
        try:
            for i in range(2 * memory._sweep_at + 500):  # several sweeps on the way
                out = f(w, x)
                if i % 50 == 0:
                    kept[key].append(out)
        except Exception as exc:  # a failure in a thread must fail the test
            errors.append(exc)

    run_in_threads(worker, [0, 1])
    assert not errors
    regions = {id(r) for r in memory.live_regions()}
    outs = kept[0] + kept[1]
    assert len(outs) > 2 * 20 and all(id(out.grad_fn) in regions for out in outs)
