"""Fingerprints of memory_frontier's rows and of every plan it lowers, to show a change to the
planner or the lowering exact: run before and after, the lines must be equal. Each lowered plan
is fingerprinted by what its peak and its code follow from (kernels with their nodes, recomputed
values and shapes, row runs, steps, the values needing a buffer, the buffers, and the layout:
outputs, arena offsets and sizes, saved buffers reused, row-local rows), its values named by
their place in the plan's graph, never by identity; the frontier by its rows and floor.

    python -m backplan.bench.frontier_digest [--models chain,mlp_deep,transformer] [--changes]

--changes: for each row after the first, what its lowered plan shares with the row before it
(the rows of a chain's frontier are nested, each graph the one before with one block of nodes
inserted): the kernels found unchanged once the nodes after the block are renumbered, and the
buffers placed at the same offset. What a lowering made incremental across rows could reuse.
"""

from __future__ import annotations

import argparse
import hashlib
from contextlib import contextmanager

import backplan as bp
from backplan.bench import internals

from .budget_models import MODEL_MAKERS, deep_chain


def lowered_fingerprint(lowered) -> str:
    """A digest of one lowered plan (ir/lowering.py LoweredPlan) by position, not identity:
    the same plan lowered twice, or from an equal graph, gives the same digest."""
    graph = lowered.plan.graph
    place = {v: i for i, v in enumerate([*graph.inputs, *graph.nodes])}

    def at(values) -> list:
        return [place.get(v, -1) for v in values]

    kernels = [
        (k.kind, at(k.all_nodes), at(k.recomputed), tuple(k.shape), k.epilogue is not None)
        for k in lowered.kernels
    ]
    layout = lowered.layout
    described = (
        kernels,
        lowered.row_runs,
        lowered.steps,
        sorted(at(lowered.materialized)),
        at(lowered.buffers),
        at(layout.outputs),
        sorted((place.get(v, -1), o) for v, o in layout.scratch_offsets.items()),
        sorted(layout.scratch_elements.items()),
        sorted((place.get(v, -1), place.get(s, -1)) for v, s in layout.reused_saved.items()),
        sorted((place.get(v, -1), r) for v, r in layout.row_local.items()),
        sorted(lowered.donations.items()),
    )
    return hashlib.sha1(repr(described).encode()).hexdigest()[:16]


def _described(lowered) -> tuple:
    """(ops in node order, inputs count, kernels by place, buffer place -> scratch offset)."""
    graph = lowered.plan.graph
    place = {v: i for i, v in enumerate([*graph.inputs, *graph.nodes])}

    def at(values) -> tuple:
        return tuple(place.get(v, -1) for v in values)

    kernels = [(k.kind, at(k.all_nodes), at(k.recomputed), k.epilogue) for k in lowered.kernels]
    kernels = [(kind, nodes, again, e is not None) for kind, nodes, again, e in kernels]
    offsets = {place[b]: lowered.layout.scratch_offsets.get(b) for b in lowered.buffers}
    return [n.op for n in graph.nodes], len(graph.inputs), kernels, offsets


def row_changes(before, after) -> dict:
    """What lowered plan `after` shares with `before` (two _described plans) where after's
    graph is before's with one block of nodes inserted where their ops first differ: kernels
    unchanged and buffers at the same offset, before's places after the block moved by its
    length."""
    ops0, inputs, kernels0, offsets0 = before
    ops1, _, kernels1, offsets1 = after
    pairs = enumerate(zip(ops0, ops1, strict=False))  # the shorter graph's length
    start = next((i for i, (a, b) in pairs if a != b), len(ops0)) + inputs
    shift = len(ops1) - len(ops0)

    def moved(places) -> tuple:
        return tuple(p if p < start else p + shift for p in places)

    old = {(kind, moved(n), moved(r), e) for kind, n, r, e in kernels0}
    old_offsets = {moved((p,))[0]: o for p, o in offsets0.items()}
    at = start - inputs
    return {
        "one block": shift >= 0 and ops1[at + shift :] == ops0[at:],  # else the counts mislead
        "block at": at,
        "nodes inserted": shift,
        "kernels": len(kernels1),
        "unchanged": sum(1 for k in kernels1 if k in old),
        "buffers": len(offsets1),
        "same offset": sum(1 for p, o in offsets1.items() if old_offsets.get(p, -1) == o),
    }


@contextmanager
def recorded_lowerings(record):
    """Yields the list of record(lowered) of the plans lowered inside it, in order."""
    owner, found = internals.lowering, []
    original = owner._lower

    def recording(plan, *args, **kwargs):
        lowered = original(plan, *args, **kwargs)
        found.append(record(lowered))
        return lowered

    owner._lower = recording
    try:
        yield found
    finally:
        owner._lower = original


def described_lowerings():
    """Yields the list of _described plans lowered inside it, in order."""
    return recorded_lowerings(_described)


def fingerprinted_lowerings():
    """Yields the list of fingerprints of the plans lowered inside it, in order."""
    return recorded_lowerings(lowered_fingerprint)


def frontier_digest(fn, params, batch) -> tuple[str, list[str], list[int]]:
    """(a digest of memory_frontier's rows and floor, each lowered plan's fingerprint, the
    rows' peaks) of a fresh value_and_grad of fn."""
    step = bp.value_and_grad(fn)
    with fingerprinted_lowerings() as lowered:
        step.trace(params, *batch)
        frontier = step.memory_frontier(params, *batch)
    rows = hashlib.sha1(repr((frontier.points, frontier.floor)).encode()).hexdigest()[:16]
    return rows, list(lowered), [p.peak_bytes for p in frontier.points]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="chain,mlp_deep,transformer")
    parser.add_argument("--changes", action="store_true")
    args = parser.parse_args(argv)
    for name in args.models.split(","):
        fn, params, batch = deep_chain() if name == "chain" else MODEL_MAKERS[name]()
        if args.changes:
            print(changes_text(name, fn, params, batch))
            continue
        rows, lowered, peaks = frontier_digest(fn, params, batch)
        plans = hashlib.sha1(" ".join(lowered).encode()).hexdigest()[:16]
        print(
            f"{name}: {len(peaks)} rows, rows and floor {rows}, {len(lowered)} plans lowered "
            f"{plans}, peaks {peaks[0]:,} .. {peaks[-1]:,}"
        )


def changes_text(name: str, fn, params, batch) -> str:
    step = bp.value_and_grad(fn)
    with described_lowerings() as plans:
        step.trace(params, *batch)
        step.memory_frontier(params, *batch)
    lines = [f"{name}: {len(plans)} plans lowered"]
    for before, after in zip(plans, plans[1:], strict=False):
        c = row_changes(before, after)
        block = "" if c["one block"] else " (not one block inserted: counts not comparable)"
        lines.append(
            f"  {c['nodes inserted']:+,} nodes at node {c['block at']:,}{block}: kernels unchanged "
            f"{c['unchanged']:,} of {c['kernels']:,} ({100 * c['unchanged'] / c['kernels']:.1f}%), "
            f"buffers at the same offset {c['same offset']:,} of {c['buffers']:,} "
            f"({100 * c['same offset'] / max(c['buffers'], 1):.1f}%)"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
