"""The joint plan cut into segments at bucket boundaries, so a bucket's allreduce can start while
the rest of the backward still runs. Each segment is a plan of its own (compiled on its own);
values that cross a cut become outputs of the segment that writes them and inputs of those that
read them. Cutting costs fusion across the cut and a fresh allocation per crossing value."""

from __future__ import annotations

from dataclasses import dataclass, field

from backplan.ir.graph import Graph, Value
from backplan.ir.liveness import Plan, plan_liveness
from backplan.runtime.backend import runner_for


@dataclass
class Segment:
    """Steps first_step..last_step of the joint plan as one plan: `inputs` and `outputs` are the
    joint plan's values it reads from before the cut and writes for after it."""

    plan: Plan
    first_step: int
    last_step: int
    inputs: list[Value]
    outputs: list[Value]
    done_with: list[Value]  # values no later segment reads and the plan does not return
    _runners: dict = field(default_factory=dict)

    def runner(self):
        return runner_for(self.plan, self._runners)


def split_plan(plan: Plan, cuts: list[int]) -> list[Segment]:
    """Segments ending after each step in cuts (and after the last step); run them with
    run_segments, which gives the same outputs as the joint plan."""
    graph = plan.graph
    last = len(graph.nodes) - 1
    ends = sorted({c for c in cuts if 0 <= c < last}) + [last]
    groups, start = [], 0
    for end in ends:
        groups.append(graph.nodes[start : end + 1])
        start = end + 1
    segment_of = {node: k for k, group in enumerate(groups) for node in group}
    read_until = _last_reading_segment(groups, graph.outputs)
    segments, first = [], 0
    for k, group in enumerate(groups):
        segments.append(_segment(graph, group, k, segment_of, read_until, first))
        first += len(group)
    return segments


def _last_reading_segment(groups: list, outputs: list[Value]) -> dict[Value, int]:
    """For every value, the last segment that reads it; the joint plan's outputs count as read
    after the last segment."""
    read_until: dict[Value, int] = {}
    for k, group in enumerate(groups):
        for node in group:
            for value in node.inputs:
                read_until[value] = k
    for value in outputs:
        read_until[value] = len(groups)
    return read_until


def _segment(graph: Graph, group: list, k: int, segment_of: dict, read_until: dict, first: int):
    sub = Graph(f"{graph.name}_part{k}", constants=dict(graph.constants))
    mapping: dict[Value, Value] = {}
    inputs = []
    for node in group:
        for value in node.inputs:
            if value not in mapping and segment_of.get(value) != k:
                mapping[value] = sub.add_input(value.type, role="arg", loc=value.loc)
                inputs.append(value)
        mapping[node] = Value(
            node.op, [mapping[v] for v in node.inputs], node.attrs, node.type, node.loc
        )
        sub.nodes.append(mapping[node])
    outputs = [node for node in group if read_until.get(node, -1) > k]
    sub.outputs = [mapping[node] for node in outputs]
    done_with = [v for v in inputs if read_until[v] == k and segment_of.get(v) is not None]
    last = first + len(group) - 1
    return Segment(plan_liveness(sub), first, last, inputs, outputs, done_with)


def run_segments(segments: list[Segment], plan: Plan, arrays: list, after_segment) -> list:
    """Run the segments in order on the joint plan's input arrays; after_segment(segment, env)
    is called after each (env: joint-plan value -> array). Returns the joint plan's outputs."""
    env = dict(zip(plan.graph.inputs, arrays, strict=True))
    for segment in segments:
        produced = segment.runner()([env[v] for v in segment.inputs])
        env.update(zip(segment.outputs, produced, strict=True))
        for value in segment.done_with:
            del env[value]
        after_segment(segment, env)
    return [env[v] for v in plan.graph.outputs]
