"""The one pipeline, read top to bottom:

    trace -> cleanup -> fuse attention -> autodiff -> cleanup -> rematerialize -> cleanup
          -> liveness -> lower: fusion -> schedule -> memory plan        (ir/lowering.py)

`build_region_plans` runs it for a compiled function's region (a forward plan, and a backward
plan that reads saved buffers), then expands layer_norm and tanh-gelu into primitives once the
saved values are chosen; `build_joint_plan` for value_and_grad, which expands them before its
cleanup (forward and derivative share one tanh) and needs no saved buffers:
its rematerialisation (`rematerialize_joint`) copies cheap chains into its gradient part
instead of holding their values across, after the last cleanup.
Each step is a named pure function that returns a new graph (the graph it is given is never
changed), recorded under its name. The result is data: `RegionPlans.lowered(...)` and
`lower(plan)` give the lowered plan that codegen renders and explain, export and the runtime
read, computed once per plan and backward mode; what follows from it is kept with it, once:
its rendering (`lowered.rendered`, kernel hashes and compile estimates included) and its
donation pairs (`lowered.donations`). BACKPLAN_DEBUG_IR=1 prints the IR after every
pass; BACKPLAN_VERIFY=1 (set by the test suite) runs the verifier after every pass.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, replace

from .attention_fusion import fuse_attention
from .autodiff import append_gradients, backward_graph, reaching_inputs
from .errors import BackplanError
from .graph import Graph, Value
from .layout import storage_root
from .liveness import Plan, plan_liveness
from .lowering import BackwardMode, LoweredPlan, lower
from .passes import (
    algebraic_simplification,
    common_subexpression_elimination,
    dead_code_elimination,
    expand_layer_norm,
    expand_tanh_gelu,
    flatten_shared_matmuls,
)
from .remat import (
    Recomputed,
    forward_nodes,
    recompute_chosen,
    recompute_joint_chosen,
    rematerialize,
    rematerialize_joint,
)
from .saved_dtype import narrowed_saved
from .step_schedule import StepSchedule, step_schedule
from .types import is_float
from .verify import verify_graph, verify_plan

CLEANUP = (algebraic_simplification, common_subexpression_elimination, dead_code_elimination)


@dataclass
class PassLog:
    """Which pass produced which IR; filled when debugging or asked for."""

    entries: list[tuple[str, str]] = field(default_factory=list)
    echo: bool = False
    verify: bool = False

    def record(self, name: str, graph: Graph) -> Graph:
        if self.verify:
            verify_graph(graph)
        if self.echo:
            print(f"--- after {name}\n{graph}", file=sys.stderr)
            self.entries.append((name, str(graph)))
        return graph


def new_log() -> PassLog:
    return PassLog(
        echo=os.environ.get("BACKPLAN_DEBUG_IR") == "1",
        verify=os.environ.get("BACKPLAN_VERIFY") == "1",
    )


def cleanup(graph: Graph, log: PassLog) -> Graph:
    for pass_fn in CLEANUP:
        graph = log.record(pass_fn.__name__, pass_fn(graph))
    return graph


def attention_fusion_on() -> bool:
    """BACKPLAN_FUSE_ATTENTION=0 keeps hand-written attention as written (to compare, or where
    the (T, S) scores fit and recomputing them costs more than keeping them)."""
    value = os.environ.get("BACKPLAN_FUSE_ATTENTION", "1").strip()
    if value not in ("0", "1", ""):
        raise BackplanError(f"BACKPLAN_FUSE_ATTENTION={value!r}: use 1 (the default) or 0")
    return value != "0"


def traced(graph: Graph, log: PassLog) -> Graph:
    """The traced graph cleaned up, with hand-written attention fused before differentiation
    (so its derivative is the fused one) and batched products with a shared matrix flattened
    (ir/passes.py flatten_shared_matmuls)."""
    graph = cleanup(log.record("trace", graph), log)
    if attention_fusion_on():
        fused = fuse_attention(graph)
        graph = graph if fused is graph else cleanup(log.record("fuse_attention", fused), log)
    flat = flatten_shared_matmuls(graph)
    return graph if flat is graph else cleanup(log.record("flatten_shared_matmuls", flat), log)


@dataclass
class SavedSlot:
    """Where a saved buffer comes from when the forward runs: ("input", i) is region input i,
    ("output", j) is forward-plan output j. `forward` is the forward value, `reason` the rule."""

    source: tuple[str, int]
    forward: Value
    reason: str


@dataclass
class RegionPlans:
    """Everything needed to run a region forward now and backward later."""

    forward: Plan  # outputs: the user's outputs, then the saved values it computes
    backward: Plan | None  # inputs: one cotangent per float output, then the saved buffers
    saved: list[SavedSlot]
    n_outputs: int
    wrt: list[bool]
    log: PassLog
    recomputed: list = field(default_factory=list)  # remat.Recomputed: rebuilt, not saved

    @property
    def n_cotangents(self) -> int:
        """Backward inputs before the saved buffers: one per float user output."""
        return sum(is_float(o.dtype) for o in self.forward.graph.outputs[: self.n_outputs])

    def private_saved_inputs(self) -> tuple[int, ...]:
        """Backward inputs holding saved buffers that only this region's graph can see:
        computed by the forward, not a user output, not sharing storage with one."""
        forward = self.forward.graph
        public = {storage_root(v) for v in forward.outputs[: self.n_outputs]}
        public |= set(forward.inputs)
        return tuple(
            self.n_cotangents + slot
            for slot, saved in enumerate(self.saved)
            if saved.source[0] == "output" and storage_root(saved.forward) not in public
        )

    def lowered(self, mode: BackwardMode | None = None) -> LoweredPlan:
        """The forward plan lowered (mode None), or the backward plan in that mode."""
        if mode is None:
            return lower(self.forward)
        private = self.private_saved_inputs() if mode is BackwardMode.CONSUME else ()
        return lower(self.backward, private)


def build_region_plans(
    graph: Graph,
    wrt: list[bool],
    log: PassLog | None = None,
    remat: bool = True,
    saved_bytes_budget: int | None = None,
    expand: bool = True,
) -> RegionPlans:
    """remat: recompute cheap chains in backward instead of saving them (ir/remat.py), until
    the saved bytes fit saved_bytes_budget (None: whenever it lowers them). expand: rewrite
    layer_norm (both plans) and tanh-gelu (backward) into primitives once the saved values are
    chosen, as the joint plan does, so fusion makes row loops of them (eager one-op regions
    keep the single kernel)."""
    return region_choices(graph, wrt, log, remat, saved_bytes_budget, expand).plans()


@dataclass
class RegionChoices:
    """A region differentiated, with the default choice of what backward recomputes made:
    `plans(drop)` finishes the plans recomputing, besides, the saved values `drop` names (ids
    of `schedule`, the memory planner's view: ir/budget.py). Each call builds afresh."""

    graph: Graph
    wrt: list[bool]
    log: PassLog
    expand: bool
    backward: Graph | None = None
    saved: list = field(default_factory=list)  # autodiff.SavedValue, after the default remat
    recomputed: list = field(default_factory=list)
    saved_dtype: str | None = None  # the dtype the saved values the forward computes are kept in
    _schedule: StepSchedule | None = None

    @property
    def schedule(self) -> StepSchedule:
        if self._schedule is None:
            bwd = self.backward
            alias = {s.backward_input: s.forward for s in self.saved}
            inputs = self.graph.inputs + [v for v in bwd.inputs if v not in alias]
            self._schedule = step_schedule(
                self.graph.nodes + bwd.nodes,
                set(bwd.nodes),
                self.graph.outputs + bwd.outputs,
                inputs,
                alias,
            )
        return self._schedule

    def plans(self, drop: frozenset[int] = frozenset()) -> RegionPlans:
        graph, log, expand = self.graph, self.log, self.expand
        if self.backward is None:
            return RegionPlans(
                _plan(_expanded(graph, log, expand), log),
                None,
                [],
                len(graph.outputs),
                self.wrt,
                log,
            )
        bwd, saved, recomputed = self.backward, self.saved, list(self.recomputed)
        if drop:
            chosen = {self.schedule.values[i] for i in drop}
            bwd, saved, more = recompute_chosen(graph, bwd, saved, chosen)
            recomputed += more
            bwd = cleanup(log.record("recompute_for_budget", bwd), log)
        plans = _finish_region(graph, bwd, saved, recomputed, self.wrt, log, expand)
        return plans if self.saved_dtype is None else _narrowed(plans, self.saved_dtype)


def region_choices(
    graph: Graph,
    wrt: list[bool],
    log: PassLog | None = None,
    remat: bool = True,
    saved_bytes_budget: int | None = None,
    expand: bool = True,
    saved_dtype: str | None = None,
) -> RegionChoices:
    """The region pipeline up to the choice of what backward recomputes (see RegionChoices).
    saved_dtype: store the saved values the forward computes in this dtype (bf16)."""
    log = log or new_log()
    graph = traced(graph, log)
    wrt = reaching_inputs(graph, wrt)
    if not any(wrt):
        return RegionChoices(graph, wrt, log, expand)
    bwd, saved = backward_graph(graph, wrt)
    bwd = cleanup(log.record("autodiff", bwd), log)
    saved = read_saved(bwd, saved)
    recomputed = []
    if remat:
        bwd, saved, recomputed = rematerialize(graph, bwd, saved, saved_bytes_budget)
        bwd = cleanup(log.record("rematerialize", bwd), log)
    return RegionChoices(graph, wrt, log, expand, bwd, saved, recomputed, saved_dtype)


def _narrowed(plans: RegionPlans, dtype: str) -> RegionPlans:
    """The plans with the saved values their forward computes stored in dtype (a bfloat16
    round trip, ir/saved_dtype.py), planned again."""
    forward, backward, slots = narrowed_saved(
        plans.forward.graph, plans.backward.graph, plans.saved, plans.n_outputs, dtype
    )
    log = plans.log
    forward = _plan(log.record("saved_dtype", forward), log)
    backward = _plan(log.record("saved_dtype", backward), log)
    return replace(plans, forward=forward, backward=backward, saved=slots)


def _finish_region(graph, bwd, saved, recomputed, wrt, log, expand) -> RegionPlans:
    """Expand the backward, order its inputs, and make the forward return what is saved."""
    n_outputs = len(graph.outputs)
    if expand:
        bwd = cleanup(log.record("expand_tanh_gelu", expand_tanh_gelu(bwd)), log)
        bwd = cleanup(log.record("expand_layer_norm", expand_layer_norm(bwd)), log)
    bwd = log.record("saved_inputs_last", saved_inputs_last(bwd, saved))
    inputs = {v: i for i, v in enumerate(graph.inputs)}
    extra = [s.forward for s in saved if s.forward not in inputs and s.forward not in graph.outputs]
    fwd = _with_outputs(graph, graph.outputs + extra)
    made: dict[Value, list[Value]] = {}
    fwd = _expanded(fwd, log, expand, made)
    recomputed = [_moved(r, made) for r in recomputed]
    slots = []
    for s in saved:
        if s.forward in inputs:
            slots.append(SavedSlot(("input", inputs[s.forward]), s.forward, s.reason))
        else:
            at = (graph.outputs + extra).index(s.forward)  # the same place after expanding
            slots.append(SavedSlot(("output", at), fwd.outputs[at], s.reason))
    return RegionPlans(_plan(fwd, log), _plan(bwd, log), slots, n_outputs, wrt, log, recomputed)


def read_saved(backward: Graph, saved: list) -> list:
    """The saved values backward still reads after cleanup (others were simplified away)."""
    used = {i for node in backward.nodes for i in node.inputs} | set(backward.outputs)
    return [s for s in saved if s.backward_input in used]


def saved_inputs_last(backward: Graph, saved: list) -> Graph:
    """backward with its inputs ordered as the runtime passes them: cotangents, then one
    input per saved value, in the order of `saved`."""
    inputs = [v for v in backward.inputs if v.role != "saved"] + [s.backward_input for s in saved]
    graph = _with_outputs(backward, list(backward.outputs))
    graph.inputs = inputs
    return graph


def _expanded(forward: Graph, log: PassLog, expand: bool, made: dict | None = None) -> Graph:
    """The forward with layer_norm expanded, without cleanup: `made` maps each old node to the
    nodes standing for it, which the saved slots and the recomputed rows are moved onto."""
    if not expand:
        return forward
    return log.record("expand_layer_norm", expand_layer_norm(forward, made))


def _moved(recomputed: Recomputed, made: dict) -> Recomputed:
    if not made:  # nothing was expanded: the same nodes
        return recomputed
    chain = tuple(n for old in recomputed.chain for n in made[old])
    return replace(recomputed, forward=made[recomputed.forward][-1], chain=chain)


def build_joint_plan(graph: Graph, wrt: list[bool], log: PassLog | None = None) -> Plan:
    """value_and_grad: outputs are the original outputs, then d(outputs[0])/d(wrt inputs)."""
    return joint_choices(graph, wrt, log).plan()


@dataclass
class JointChoices:
    """A joint plan with the default rematerialisation done: `plan(drop)` is the plan that
    also recomputes the held values `drop` names (ids of `schedule`: ir/budget.py)."""

    graph: Graph
    n_outputs: int
    log: PassLog
    _schedule: StepSchedule | None = None
    _default: Plan | None = None

    @property
    def schedule(self) -> StepSchedule:
        if self._schedule is None:
            graph = self.graph
            forward = forward_nodes(graph, self.n_outputs)
            later = {n for n in graph.nodes if n not in forward}
            self._schedule = step_schedule(graph.nodes, later, graph.outputs, graph.inputs)
        return self._schedule

    def plan(self, drop: frozenset[int] = frozenset()) -> Plan:
        if not drop:
            if self._default is None:
                self._default = _plan(self.graph, self.log)
            return self._default
        chosen = {self.schedule.values[i] for i in drop}
        graph = recompute_joint_chosen(self.graph, self.n_outputs, chosen)
        return _plan(self.log.record("recompute_for_budget", graph), self.log)


def joint_choices(graph: Graph, wrt: list[bool], log: PassLog | None = None) -> JointChoices:
    """The joint pipeline up to the choice of what the gradient part recomputes."""
    log = log or new_log()
    graph = traced(graph, log)
    joint = _with_outputs(graph, list(graph.outputs))
    n_outputs = len(joint.outputs)
    grads = append_gradients(joint, wrt)
    joint.outputs = joint.outputs + grads
    joint = log.record("autodiff", joint)
    joint = cleanup(log.record("expand_tanh_gelu", expand_tanh_gelu(joint)), log)
    joint = cleanup(log.record("expand_layer_norm", expand_layer_norm(joint)), log)
    # after the last cleanup: common-subexpression elimination would merge the copies back
    joint = log.record("rematerialize", rematerialize_joint(joint, n_outputs))
    return JointChoices(joint, n_outputs, log)


def _with_outputs(graph: Graph, outputs: list[Value]) -> Graph:
    """The same nodes in a new graph (lists copied: the caller's own are never changed)."""
    return Graph(graph.name, list(graph.inputs), list(graph.nodes), outputs, dict(graph.constants))


def _plan(graph: Graph, log: PassLog) -> Plan:
    plan = plan_liveness(graph)
    if log.verify:
        verify_plan(plan)
    if log.echo:
        print(f"--- plan\n{plan.text()}", file=sys.stderr)
    return plan
