"""bench/frontier_digest.py: the fingerprints that show a planner or lowering change exact are
equal for equal plans built apart (values named by place, not identity) and differ where a
plan's kernels or layout differ."""

from dataclasses import replace

import backplan as bp
from backplan.bench import frontier_digest, internals
from backplan.bench.budget_models import deep_chain
from backplan.runtime.backend import use_backend


def test_equal_plans_built_apart_fingerprint_equal_and_different_rows_differ():
    fn, params, batch = deep_chain(6)
    before = internals.lowering._lower
    with use_backend("numba"):  # rows lowered (the reference interpreter simulates them)
        first = frontier_digest.frontier_digest(fn, params, batch)
        second = frontier_digest.frontier_digest(fn, params, batch)
    assert internals.lowering._lower is before  # put back
    rows, lowered, peaks = first
    assert len(peaks) >= 2 and len(lowered) >= len(peaks) - 1
    assert first == second  # fresh traces, fresh values: the same digests
    assert len(set(lowered)) == len(lowered)  # each row's plan recomputes other values


def test_a_moved_buffer_changes_the_fingerprint():
    lowered = _one_lowered(*deep_chain(6))
    fingerprint = frontier_digest.lowered_fingerprint(lowered)
    offsets = dict(lowered.layout.scratch_offsets)
    value = next(iter(offsets))
    offsets[value] += 16
    moved = replace(lowered, layout=replace(lowered.layout, scratch_offsets=offsets))
    assert frontier_digest.lowered_fingerprint(moved) != fingerprint
    kernels = list(reversed(lowered.kernels))
    assert frontier_digest.lowered_fingerprint(replace(lowered, kernels=kernels)) != fingerprint


def _one_lowered(fn, params, batch):
    """The last plan a memory_frontier lowers."""
    found = []
    original = internals.lowering._lower

    def keeping(plan, *args):
        lowered = original(plan, *args)
        found.append(lowered)
        return lowered

    internals.lowering._lower = keeping
    try:
        with use_backend("numba"):
            vg = bp.value_and_grad(fn)
            vg.trace(params, *batch)
            vg.memory_frontier(params, *batch)
    finally:
        internals.lowering._lower = original
    assert found
    return found[-1]


def test_each_chain_row_is_the_row_before_plus_one_block_and_regroups_only_around_it():
    """The chain's rows are nested: each graph is the row before's with one block of nodes
    inserted (the plans weighed after the rows need not be), and its grouping changes only
    there (what an incremental lowering would reuse):
    at most one new kernel per node inserted, every other kernel the same nodes once the
    nodes after the block are renumbered."""
    fn, params, batch = deep_chain(12)
    with use_backend("numba"), frontier_digest.described_lowerings() as plans:
        vg = bp.value_and_grad(fn)
        vg.trace(params, *batch)
        vg.memory_frontier(params, *batch)
    changes = [frontier_digest.row_changes(a, b) for a, b in zip(plans, plans[1:], strict=False)]
    nested = [c for c in changes if c["one block"]]  # the rows; plans weighed after need not be
    assert len(nested) >= 4 and changes[0]["one block"]
    for change in nested:
        assert change["nodes inserted"] > 0
        assert change["kernels"] - change["unchanged"] <= change["nodes inserted"]
        assert 0 < change["same offset"] <= change["buffers"]
    assert frontier_digest.row_changes(plans[0], plans[0])["unchanged"] == len(plans[0][2])
