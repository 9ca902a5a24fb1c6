"""On the reference backend a plan with 16-bit values runs widened, and where a compiled loop
reads a value unrounded the interpreter reads (and so holds) the float32 value too
(ir/rounding_points.py). explain's saved list, its saved bytes and the memory frontier's saved
column are those of the plan that runs: a float32 value of the forward part the gradient part
reads that way is a row of its own (report/widened_saved.py). Checked against the interpreter
itself: each such value is in its environment when the gradient-part op reading it runs."""

from __future__ import annotations

import pytest

import backplan as bp
from backplan.bench.memory_audit import model_step
from backplan.bench.memory_calls import model_arrays
from backplan.bench.models import MODELS
from backplan.bench.peers.backplan_peer import bench_function
from backplan.ir.interpreter import run_plan
from backplan.ir.lowering import lower
from backplan.ir.remat import forward_nodes, held_across
from backplan.ir.rounding_points import spec_values
from backplan.ir.types import np_dtype
from backplan.runtime.backend import use_backend

MODELS_SMALL = ("mlp", "ln_gelu", "transformer")


def _held_by_interpreter(plan, n_outputs: int, arrays: list) -> int:
    """Bytes of the forward values (no inputs) the interpreter holds for the gradient part of
    the widened plan it runs: read by a gradient-part op, directly or in a cast's place, and
    in its environment when that op runs."""
    interpreted = lower(plan).interpreted or plan
    graph = interpreted.graph
    forward = forward_nodes(graph, n_outputs)
    wanted: dict = {}  # value -> the gradient-part steps reading it
    step_of = {node: step for step, node in enumerate(graph.nodes)}
    for value in held_across(graph, forward):
        for node in graph.nodes:
            if node not in forward and value in node.inputs:
                wanted.setdefault(value, set()).add(step_of[node])
    specs = list(interpreted.unrounded.items())
    specs += [(n, s) for n, reads in interpreted.reads_instead.items() for s in reads.values()]
    for node, spec in specs:
        if node not in forward:
            for value in spec_values(spec):
                if value in forward:
                    wanted.setdefault(value, set()).add(step_of[node])
    inputs = set(graph.inputs)
    seen: set = set()

    def on_step(step: int, env: dict) -> None:
        for value, steps in wanted.items():
            if step in steps and value in env:
                seen.add(value)

    run_plan(interpreted, list(arrays), on_step=on_step)
    assert seen == set(wanted)  # every one is held until the op reading it runs
    return sum(v.type.nbytes for v in seen if v not in inputs)


@pytest.mark.parametrize("name", MODELS_SMALL)
def test_value_and_grad_lists_what_the_widened_plan_holds(name):
    params, batch = model_arrays(name, dtype="bfloat16")
    with use_backend("reference"):
        fn = bp.value_and_grad(bench_function(MODELS[name]))
        report = bp.explain(fn, params, *batch)
        plan = report.plans["joint"]
        arrays = [t.numpy() for t in bp.tree.leaves((params, *batch))]
        held = _held_by_interpreter(plan, 1, arrays)
        frontier = fn.memory_frontier(params, *batch)
    allocated = report.saved_bytes - report.saved_input_bytes
    assert allocated == held
    widened = [b for b in report.saved_buffers if b.name.endswith(" in f32")]
    assert widened and all(b.dtype == np_dtype("f32") for b in widened)
    assert all(b.read_by and b.last_read_step >= 0 for b in widened)
    assert frontier.points[0].saved_bytes == allocated
    assert " in f32 " in str(report)


def test_numba_lists_no_float32_rows():
    """The compiled loops compute those float32 values where they read them: nothing held."""
    params, batch = model_arrays("ln_gelu", dtype="bfloat16")
    with use_backend("numba"):
        report = bp.explain(bp.value_and_grad(bench_function(MODELS["ln_gelu"])), params, *batch)
    assert not [b for b in report.saved_buffers if b.name.endswith(" in f32")]


def test_a_training_step_lists_the_float32_values_its_inlined_gradients_hold():
    with use_backend("reference"):
        step, args, _ = model_step("ln_gelu", "train")
        args = bp.tree.map(
            lambda t: (
                bp.tensor(t.numpy().astype(np_dtype("bf16"))) if t.numpy().dtype.kind == "f" else t
            ),
            args,
        )
        report = bp.explain(step, *args)
        frontier = step.memory_frontier(*args)
    rows = report.inlined_saved
    widened = [b for b in rows if b.name.endswith(" in f32")]
    assert widened and all(b.read_by for b in widened)
    allocated = sum(b.nbytes for b in rows if not b.is_region_input)
    assert frontier.points[0].saved_bytes == allocated
