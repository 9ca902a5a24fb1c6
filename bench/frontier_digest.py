"""Fingerprints of memory_frontier's rows and of every plan it lowers, to show a change to the
planner or the lowering exact: run before and after, the lines must be equal. Each lowered plan
is fingerprinted by what its peak and its code follow from (kernels with their nodes, recomputed
values and shapes, row runs, steps, the values needing a buffer, the buffers, and the layout:
outputs, arena offsets and sizes, saved buffers reused, row-local rows), its values named by
their place in the plan's graph, never by identity; the frontier by its rows and floor.

    python -m backplan.bench.frontier_digest [--models chain,mlp_deep,transformer]
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


@contextmanager
def fingerprinted_lowerings():
    """Yields the list of fingerprints of the plans lowered inside it, in order."""
    owner, found = internals.lowering, []
    original = owner._lower

    def fingerprinting(plan, *args, **kwargs):
        lowered = original(plan, *args, **kwargs)
        found.append(lowered_fingerprint(lowered))
        return lowered

    owner._lower = fingerprinting
    try:
        yield found
    finally:
        owner._lower = original


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
    args = parser.parse_args(argv)
    for name in args.models.split(","):
        fn, params, batch = deep_chain() if name == "chain" else MODEL_MAKERS[name]()
        rows, lowered, peaks = frontier_digest(fn, params, batch)
        plans = hashlib.sha1(" ".join(lowered).encode()).hexdigest()[:16]
        print(
            f"{name}: {len(peaks)} rows, rows and floor {rows}, {len(lowered)} plans lowered "
            f"{plans}, peaks {peaks[0]:,} .. {peaks[-1]:,}"
        )


if __name__ == "__main__":
    main()
