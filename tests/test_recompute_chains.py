"""The memory planner's recomputation (ir/remat.py recompute_after) walks each value's chain
back only to what is held or already copied; the full form computes one whole chain per value
(back to the values still held) and copies what is not copied yet. Both must give the same
graph, node for node, on runs of recomputed layers, scattered choices and every frontier row."""

import numpy as np
import pytest

import backplan as bp
from backplan.ir import remat


def _structure(graph) -> list[tuple]:
    """Each node as (op, its inputs' positions, type): equal for equal graphs of fresh values."""
    position = {v: i for i, v in enumerate(list(graph.inputs) + list(graph.nodes))}
    return [(n.op, tuple(position[i] for i in n.inputs), str(n.type)) for n in graph.nodes] + [
        ("out", tuple(position[o] for o in graph.outputs), "")
    ]


def _full_chains(graph, forward, chosen):
    """The rewrite as it was: every chosen value's whole chain, then the copies."""
    held = remat.held_across(graph, forward)
    available = (set(held) - chosen) | set(graph.inputs) | remat._constants(graph)
    chains = {v: remat._chain(v, available, remat.any_op, None) for v in held if v in chosen}
    return remat._recomputed_in_gradients(graph, forward, chains)[0]


def _deep_choices(layers=16, width=16, batch=128):
    rng = np.random.default_rng(0)
    params = {
        f"w{i}": rng.standard_normal((width, width)).astype(np.float32) * 0.4 for i in range(layers)
    }

    def chain(params, x):
        for i in range(layers):
            x = bp.tanh(x @ params[f"w{i}"]) + 0.5 * x
        return bp.mean(x * x)

    step = bp.value_and_grad(chain)
    x = rng.standard_normal((batch, width)).astype(np.float32)
    return step.lookup((params, x), {}, count_hit=False)[1].planner


@pytest.mark.parametrize("pick", ["run", "every_other", "rows"])
def test_the_walk_to_the_copies_gives_the_full_chains_graph(pick):
    planner = _deep_choices()
    stage, schedule = planner.choices.stage, planner.choices.schedule
    graph = stage.forward
    forward = remat.forward_nodes(graph, stage.n_outputs)
    held = [i for i in schedule.held if schedule.values[i] not in set(graph.inputs)]
    if pick == "run":
        drops = [frozenset(held)]  # every layer recomputed: chains over chains
    elif pick == "every_other":
        drops = [frozenset(held[::2])]
    else:
        drops = [p.drop for p in planner.points() if p.drop]
    assert drops and all(drops)
    for drop in drops:
        chosen = {schedule.values[i] for i in drop}
        walked = remat.recompute_after(graph, forward, chosen)[0]
        full = _full_chains(graph, forward, chosen)
        assert len(walked.nodes) > len(graph.nodes)  # something was recomputed
        assert _structure(walked) == _structure(full)
