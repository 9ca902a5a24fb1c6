"""Where the time of memory_frontier goes on the current backend: one fresh trace and
memory_frontier of the 10,086-node chain (bench.budget_models.deep_chain), each pass a row
runs timed (CPU ms a call, this process pinned, the collector paused as the planner pauses
it). BENCHMARKS.md 30 quotes it.

    python -m backplan.bench.frontier_parts
"""

from __future__ import annotations

import argparse
import functools
import gc
import time
from contextlib import contextmanager

import backplan as bp
from backplan.bench import internals

from .affinity import pin_process
from .budget_models import deep_chain
from .environment import cpu_name

# (label, where: a name of bench/internals.py, attribute, depth under the part above it)
PARTS = (
    ("points (the planner's simulated frontier)", "BudgetPlanner", "points", 0),
    ("a row's plan built", "BudgetPlanner", "build", 0),
    ("graph copied, recomputation inserted", "pipeline", "recompute_for_budget", 1),
    ("liveness", "pipeline", "_plan", 1),
    ("a row's peak", "budget_module", "step_peak_bytes", 0),
    ("lowering", "lowering", "_lower", 1),
    ("strided copies", "lowering", "copy_strided_reshapes", 2),
    ("fusion grouping", "lowering", "group_kernels", 2),
    ("cheap inputs recomputed", "fusion", "_recompute_cheap_inputs", 3),
    ("their cones over the frontier", "fusion", "_cones_over_frontier", 4),
    ("readers of the values those weigh", "fusion", "_readers", 4),
    ("state resumed where rows share nodes", "grouping_resume", "resumed_state", 3),
    ("buffers needed", "lowering", "materialized", 2),
    ("epilogues", "lowering", "absorb_epilogues", 2),
    ("row runs", "lowering", "row_runs", 2),
    ("row-local values", "lowering", "row_local_values", 2),
    ("layout", "lowering", "plan_layout", 2),
    ("lifetimes", "layout", "lifetimes", 3),
    ("arena sized from the lifetimes", "layout", "swept_arena_sizes", 3),
    ("placement (where that cannot size it)", "layout", "element_offsets", 3),
    ("donation", "lowering", "donation_pairs", 2),
    ("compiled buffers", "peak_module", "compiled_buffers", 1),
    ("a row's saved column (fused values)", "budget_module", "fused_held_bytes", 0),
)


@contextmanager
def timed_parts():
    """Each part wrapped where its caller looks it up (a module global or a class
    attribute), restored on exit; yields label -> [CPU s, calls]."""
    found: dict[str, list] = {label: [0.0, 0] for label, *_ in PARTS}
    undo = []
    for label, where, attribute, _ in PARTS:
        owner = getattr(internals, where)
        original = (
            owner.__dict__[attribute] if isinstance(owner, type) else getattr(owner, attribute)
        )
        undo.append((owner, attribute, original))
        setattr(owner, attribute, _timing(original, found[label]))
    try:
        yield found
    finally:
        for owner, attribute, original in reversed(undo):
            setattr(owner, attribute, original)


def _timing(function, into: list):
    @functools.wraps(function)
    def timed(*args, **kwargs):
        start = time.process_time()
        try:
            return function(*args, **kwargs)
        finally:
            into[0] += time.process_time() - start
            into[1] += 1

    return timed


NODES = "nodes lowered"  # found[NODES]: [nodes of every plan lowered, plans lowered]


def frontier_parts(layers: int = 1120) -> tuple[float, float, int, dict]:
    """(trace CPU s, memory_frontier CPU s, rows, label -> [CPU s, calls]) of deep_chain(layers);
    found[NODES] counts the nodes of the plans lowered instead of seconds."""
    fn, params, batch = deep_chain(layers)
    step = bp.value_and_grad(fn)
    gc.collect()
    start = time.process_time()
    step.trace(params, *batch)
    traced = time.process_time()
    with timed_parts() as found, _counted_nodes() as nodes:
        frontier = step.memory_frontier(params, *batch)
    found[NODES] = nodes
    return traced - start, time.process_time() - traced, len(frontier.points), found


@contextmanager
def _counted_nodes():
    """Yields [nodes, plans] of the plans lowered (what each pass of a row walks), counted
    outside the timed parts (the wrapper sits over the timed lowering)."""
    owner, counted = internals.lowering, [0, 0]
    original = owner._lower

    @functools.wraps(original)
    def counting(plan, *args, **kwargs):
        counted[0] += len(plan.graph.nodes)
        counted[1] += 1
        return original(plan, *args, **kwargs)

    owner._lower = counting
    try:
        yield counted
    finally:
        owner._lower = original


def parts_text(trace: float, total: float, rows: int, found: dict) -> str:
    nodes = found.get(NODES, [0, 0])[0]
    lines = [
        f"trace {trace:.3f} s, memory_frontier {total:.3f} s ({rows} rows; CPU, the passes "
        f"timed, which adds a little); {nodes:,} nodes lowered"
        + (f" ({nodes // max(found[NODES][1], 1):,} a plan; us a node lowered):" if nodes else ":")
    ]
    for label, _, _, depth in PARTS:
        seconds, calls = found[label]
        each = 1000 * seconds / calls if calls else 0.0
        per_node = f", {1e6 * seconds / nodes:.2f} us a node" if nodes else ""
        lines.append(
            f"{'  ' * (depth + 1)}{label}: {seconds:.3f} s, {calls} calls, {each:.1f} ms each"
            f"{per_node}"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    print(f"CPU: {cpu_name()}; {pin_process(1)['affinity']}")
    print(parts_text(*frontier_parts()))


if __name__ == "__main__":
    main()
