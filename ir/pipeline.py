"""The one pipeline, read top to bottom (`plan_choices`, then `PlanChoices.build`):

    trace -> cleanup -> fuse attention -> flatten shared matmuls      (traced)
          -> differentiate -> expand composites -> rematerialize      (plan_choices)
          | what else to recompute under a memory budget (ir/budget.py)
          -> recompute for budget -> expand the backward -> saved inputs last
          -> forward returns saved values -> saved dtype -> liveness  (PlanChoices.build;
             a joint plan: saved dtype (narrow_held) -> liveness; a training step with
             inlined gradients: updates right after their gradients (early_updates, kept
             where the peak falls) -> saved dtype -> liveness)
          -> lower: fusion -> epilogues -> schedule -> memory plan, donation  (ir/lowering.py)

One route serves both forms (`PipelineOptions.joint`). A compiled function's region gets a
forward plan and a backward plan that reads saved buffers; value_and_grad gets one joint plan,
forward and gradients together. Their differences are steps of the route that do nothing for
the other form: the joint plan expands layer_norm and tanh-gelu before its rematerialisation
(forward and derivative share one tanh) and copies cheap chains into its gradient part instead
of holding their values across; a region expands them once the saved values are chosen, orders
its backward's inputs and makes its forward return what is saved.

Each step is a named pure function that returns new graphs (the graphs it is given are never
changed), recorded under its name. The result is data: `RegionPlans.lowered(...)` and
`lower(plan)` give the lowered plan that codegen renders and explain, export and the runtime
read, computed once per plan and backward mode; what follows from it is kept with it, once:
its rendering (`lowered.rendered`, kernel hashes and compile estimates included) and its
donation pairs (`lowered.donations`, from the inputs the forward plan was built to donate).
A joint graph keeps why it holds each forward value (`Graph.reasons`, recorded by autodiff).
BACKPLAN_DEBUG_IR=1 prints the IR after every pass; BACKPLAN_VERIFY=1 (set by the test suite)
runs the verifier after every pass.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, replace

from .attention_fusion import fuse_attention
from .autodiff import append_gradients, backward_graph, reaching_inputs
from .errors import BackplanError
from .graph import Graph, Value, carry_reasons
from .layout import storage_root
from .liveness import Plan, plan_liveness
from .lowering import lower, stored_values
from .passes import (
    algebraic_simplification,
    common_subexpression_elimination,
    dead_code_elimination,
    expand_layer_norm,
    expand_tanh_gelu,
    flatten_shared_matmuls,
)
from .peak import joint_calls, predicted_peak_bytes, region_calls
from .plans import JointPlans, RegionPlans, SavedSlot, StepPlans
from .remat import (
    Recomputed,
    forward_nodes,
    held_across,
    recompute_after,
    recompute_chosen,
    recompute_joint_chosen,
    rematerialize,
    rematerialize_joint,
)
from .saved_dtype import (
    HeldNarrowing,
    is_saved_narrowing,
    narrowable,
    narrowed_joint,
    narrowed_saved,
    wider_than,
)
from .step_schedule import StepSchedule, step_schedule
from .update_order import UpdateOrder, updates_after_gradients
from .update_order import followed as followed_update_order
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


@dataclass(frozen=True)
class PipelineOptions:
    """What one run of the pipeline is asked for.

    joint: value_and_grad's one plan (forward, then the gradients of output 0) instead of a
    region's forward and backward. remat: recompute cheap chains in backward instead of saving
    them (ir/remat.py), until the saved bytes fit saved_bytes_budget (None: whenever it lowers
    them). expand: rewrite layer_norm and tanh-gelu into primitives, so fusion makes row loops
    of them (eager one-op regions keep the single kernel). saved_dtype: store the saved values
    the forward computes in this dtype (bfloat16). donated: forward inputs whose buffers the
    forward's outputs may be written into (bp.compile(donate_argnums=...)), a fact of the
    forward plan that its lowering turns into pairs. backend: the executor whose peak the
    plan's order is chosen for ("numba" or "reference": early_updates). copied: (forward input,
    layout) of the inputs whose arrays arrive in another layout than C order, which compiled
    calls copy on entry (ir/argument_layout.py): the plans' peaks count those copies."""

    joint: bool = False
    remat: bool = True
    saved_bytes_budget: int | None = None
    expand: bool = True
    saved_dtype: str | None = None
    donated: tuple[int, ...] = ()
    backend: str = "numba"
    copied: tuple = ()


@dataclass(frozen=True)
class Stage:
    """The graphs between two steps. forward: the traced function (joint: forward and
    gradients in one graph); backward: a region's backward, reading `saved` (autodiff's
    SavedValue) as inputs; recomputed: remat.Recomputed, rebuilt in backward, not saved."""

    forward: Graph
    wrt: list[bool]
    n_outputs: int  # the function's own outputs (a joint graph's gradients follow them)
    backward: Graph | None = None
    saved: tuple = ()
    recomputed: tuple = ()
    # A compiled step that inlines value_and_grad plans and has no backward of its own: the
    # nodes its inlined losses (and aux outputs) depend on, the part its gradients and
    # optimizer update follow (None: no value_and_grad inlined).
    inlined_forward: frozenset | None = None
    # and the gradients of those value_and_grad plans (the step's optimizer reads them)
    inlined_gradients: frozenset = frozenset()


def plan_choices(
    graph: Graph,
    wrt: list[bool],
    options: PipelineOptions | None = None,
    log: PassLog | None = None,
    inlined: list[Value] = (),
    gradients: list[Value] = (),
) -> PlanChoices:
    """The pipeline up to the choice of what backward recomputes: `build()` finishes it with
    the default choice, `build(drop)` recomputing also what `drop` names (see PlanChoices).
    inlined: values of graph that are the outputs (loss, aux) of value_and_grad plans inlined
    into it (a compiled training step): with no backward of its own, the step's memory choice
    is what its inlined gradients recompute instead of holding (split_inlined); gradients:
    their gradient values, after which the step's optimizer update may run (early_updates)."""
    options = options or PipelineOptions()
    log = log or new_log()
    if inlined and not options.joint:
        clean, forward, grads = split_inlined(graph, list(inlined), log, list(gradients))
        stage = Stage(
            clean, list(wrt), len(graph.outputs), inlined_forward=forward, inlined_gradients=grads
        )
    else:
        stage = Stage(traced(graph, log), list(wrt), len(graph.outputs))
    stage = differentiate(stage, options, log)
    stage = expand_joint(stage, options, log)
    stage = rematerialize_step(stage, options, log)
    return PlanChoices(stage, options, log)


@dataclass
class PlanChoices:
    """The pipeline's result before the memory choice: `build(drop)` finishes the plans
    recomputing, besides the default choice, the held values `drop` names (ids of `schedule`,
    the memory planner's view: ir/budget.py). A region's build is RegionPlans, a joint one's
    JointPlans; callers read either through StepPlans (ir/plans.py). Each build runs the
    remaining steps afresh (the default one is kept)."""

    stage: Stage
    options: PipelineOptions
    log: PassLog
    _schedule: StepSchedule | None = None
    _default: StepPlans | None = None
    _joint_split: tuple | None = None  # (forward_nodes, held_across) of a joint stage's graph
    _no_forward_casts: bool | None = None  # _held_known: no astype among its forward nodes

    @property
    def joint(self) -> bool:
        return self.options.joint

    @property
    def n_outputs(self) -> int:
        return self.stage.n_outputs

    @property
    def differentiated(self) -> bool:
        """Whether anything is held for a gradient (else no plan recomputes anything)."""
        return self.joint or self.stage.backward is not None or self.inlined_gradients

    @property
    def inlined_gradients(self) -> bool:
        """A step whose gradients are inlined value_and_grad plans, and no backward of its own:
        its plan recomputes in that gradient part (held_schedule, recompute_for_budget)."""
        return self.stage.inlined_forward is not None and self.stage.backward is None

    @property
    def schedule(self) -> StepSchedule:
        if self._schedule is None:
            self._schedule = held_schedule(self._ordered_stage(), self.joint)
        return self._schedule

    def _early_kept(self) -> bool:
        """Whether the default plan runs its updates right after their gradients."""
        order = getattr(self.build(), "update_order", None)
        return order is not None and order.kept

    def _ordered_stage(self) -> Stage:
        """The stage in the order its default plans run (a training step's updates moved
        right after their gradients where early_updates kept that), so that the memory
        planner's simulation sees what those plans hold."""
        if not self.inlined_gradients or not early_updates_on() or not self._early_kept():
            return self.stage
        stage = self.stage
        graph = updates_after_gradients(
            stage.forward, stage.inlined_forward, stage.inlined_gradients, self.options.donated
        )
        return replace(stage, forward=graph)

    def build(self, drop: frozenset[int] = frozenset()) -> StepPlans:
        if not drop and self._default is not None:
            return self._default
        chosen = {self.schedule.values[i] for i in drop}
        log, options = self.log, self.options
        if options.joint and chosen and self._joint_split is None:
            forward = forward_nodes(self.stage.forward, self.stage.n_outputs)
            self._joint_split = (forward, held_across(self.stage.forward, forward))
        held = [] if chosen and self._held_known() else None
        stage = recompute_for_budget(self.stage, chosen, options, log, self._joint_split, held)
        if options.joint:
            plan, narrowing = joint_plan(stage, options, log)
            plans = JointPlans(plan, stage.n_outputs, stage.wrt, log, narrowing)
            plans.held_values = None if held is None else tuple(held)
            return self._kept(drop, plans)
        if stage.backward is None:
            if self.inlined_gradients:
                decided = self._early_kept() if drop else None
                return self._kept(drop, early_updates(stage, options, log, decided))
            return self._kept(drop, _step_plans(stage, options, log))
        stage = expand_backward(stage, options, log)
        stage = order_saved_inputs(stage, log)
        plans = forward_returns_saved(stage, options, log)
        return self._kept(drop, narrow_saved(plans, options, log))

    def _held_known(self) -> bool:
        """Whether a joint plan recomputing held values knows what it holds from the rewrite
        (ir/remat.py held_recomputed): no saved_dtype (whose casts rewrite the graph after
        it), and no narrowing cast in the forward part (asked once)."""
        if not self.options.joint or self.options.saved_dtype is not None:
            return False
        if self._no_forward_casts is None:
            forward = self._joint_split[0]
            self._no_forward_casts = not any(n.op == "astype" for n in forward)
        return self._no_forward_casts

    def _kept(self, drop: frozenset[int], result):
        mark_copied(result, self.options.copied)
        if not drop:
            self._default = result
        return result


def build_region_plans(
    graph: Graph,
    wrt: list[bool],
    log: PassLog | None = None,
    remat: bool = True,
    saved_bytes_budget: int | None = None,
    expand: bool = True,
) -> RegionPlans:
    """A region's default plans: `plan_choices(...).build()` (see PipelineOptions)."""
    options = PipelineOptions(remat=remat, saved_bytes_budget=saved_bytes_budget, expand=expand)
    plans = plan_choices(graph, wrt, options, log).build()
    assert isinstance(plans, RegionPlans)  # for the type checker: a region's build
    return plans


def build_joint_plan(graph: Graph, wrt: list[bool], log: PassLog | None = None) -> Plan:
    """value_and_grad's default plan: outputs are the original outputs, then
    d(outputs[0])/d(wrt inputs)."""
    plans = plan_choices(graph, wrt, PipelineOptions(joint=True), log).build()
    assert isinstance(plans, JointPlans)  # for the type checker: a joint build
    return plans.plan


# ---- the steps, in order -----------------------------------------------------------------------


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


def early_updates_on() -> bool:
    """BACKPLAN_EARLY_UPDATES=0 keeps a training step's optimizer updates in the traced order
    (to compare peaks, times and values with the order early_updates chooses)."""
    value = os.environ.get("BACKPLAN_EARLY_UPDATES", "1").strip()
    if value not in ("0", "1", ""):
        raise BackplanError(f"BACKPLAN_EARLY_UPDATES={value!r}: use 1 (the default) or 0")
    return value != "0"


def split_inlined(
    graph: Graph, losses: list[Value], log: PassLog, gradients: list[Value] = ()
) -> tuple[Graph, frozenset, frozenset]:
    """The traced graph cleaned up (as `traced`), the nodes of it the inlined losses depend
    on, and the values standing for the inlined gradients. The losses and gradients ride along
    as extra outputs through the cleanup, whose passes rebuild nodes and map outputs onto the
    values standing for them; the dead code they kept alive (a loss the step does not return)
    is removed after."""
    n, k = len(graph.outputs), len(losses)
    clean = traced(_with_outputs(graph, list(graph.outputs) + losses + list(gradients)), log)
    needed = set(clean.outputs[n : n + k])
    for node in reversed(clean.nodes):
        if node in needed:
            needed.update(node.inputs)
    grads = clean.outputs[n + k :]
    clean = dead_code_elimination(_with_outputs(clean, clean.outputs[:n]))
    kept = set(clean.nodes)
    forward = frozenset(n for n in clean.nodes if n in needed)
    return log.record("split_inlined", clean), forward, frozenset(g for g in grads if g in kept)


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


def differentiate(stage: Stage, options: PipelineOptions, log: PassLog) -> Stage:
    """Autodiff. Joint: the gradients of output 0 appended to a copy of the forward. Region:
    wrt narrowed to the inputs that reach an output, then a backward graph reading the saved
    values it still reads after cleanup (none when nothing is differentiated)."""
    graph = stage.forward
    if options.joint:
        joint = _with_outputs(graph, list(graph.outputs))
        joint.outputs = joint.outputs + append_gradients(joint, stage.wrt)
        return replace(stage, forward=log.record("autodiff", joint))
    wrt = reaching_inputs(graph, stage.wrt)
    if not any(wrt):
        return replace(stage, wrt=wrt)
    bwd, saved = backward_graph(graph, wrt)
    bwd = cleanup(log.record("autodiff", bwd), log)
    return replace(stage, wrt=wrt, backward=bwd, saved=tuple(read_saved(bwd, saved)))


def expand_joint(stage: Stage, options: PipelineOptions, log: PassLog) -> Stage:
    """Joint: tanh-gelu and layer_norm into primitives before the cleanup that follows, so
    forward and derivative share one tanh. A region expands after choosing its saved values
    (expand_backward, forward_returns_saved)."""
    if not options.joint:
        return stage
    joint = cleanup(log.record("expand_tanh_gelu", expand_tanh_gelu(stage.forward)), log)
    joint = cleanup(log.record("expand_layer_norm", expand_layer_norm(joint)), log)
    return replace(stage, forward=joint)


def rematerialize_step(stage: Stage, options: PipelineOptions, log: PassLog) -> Stage:
    """Joint: cheap chains copied into the gradient part, after the last cleanup (common
    subexpression elimination would merge the copies back). Region (with remat): saved values
    cheap chains rebuild are recomputed in backward instead, until saved_bytes_budget fits."""
    if options.joint:
        joint = rematerialize_joint(stage.forward, stage.n_outputs)
        return replace(stage, forward=log.record("rematerialize", joint))
    if stage.backward is None or not options.remat:
        return stage
    bwd, saved, recomputed = rematerialize(
        stage.forward, stage.backward, list(stage.saved), options.saved_bytes_budget
    )
    bwd = cleanup(log.record("rematerialize", bwd), log)
    return replace(stage, backward=bwd, saved=tuple(saved), recomputed=tuple(recomputed))


def recompute_for_budget(
    stage: Stage,
    chosen: set[Value],
    options: PipelineOptions,
    log: PassLog,
    split: tuple | None = None,
    held_into: list | None = None,
) -> Stage:
    """The held values a memory budget chose recomputed too (nothing when none was chosen).
    split: a joint stage's (forward_nodes, held_across), kept by PlanChoices. held_into: a
    joint stage's, gets what its plan holds (ir/remat.py recompute_joint_chosen)."""
    if not chosen:
        return stage
    if options.joint:
        joint = recompute_joint_chosen(stage.forward, stage.n_outputs, chosen, split, held_into)
        return replace(stage, forward=log.record("recompute_for_budget", joint))
    if stage.backward is None:  # a step with inlined gradients (PlanChoices.inlined_gradients)
        step, forward, copies = recompute_after(stage.forward, set(stage.inlined_forward), chosen)
        return replace(
            stage,
            forward=log.record("recompute_for_budget", step),
            inlined_forward=forward,
            inlined_gradients=frozenset(copies[g] for g in stage.inlined_gradients),
        )
    bwd, saved, more = recompute_chosen(stage.forward, stage.backward, list(stage.saved), chosen)
    bwd = cleanup(log.record("recompute_for_budget", bwd), log)
    return replace(
        stage, backward=bwd, saved=tuple(saved), recomputed=stage.recomputed + tuple(more)
    )


def early_updates(
    stage: Stage, options: PipelineOptions, log: PassLog, decided: bool | None = None
) -> RegionPlans:
    """A training step's plans with each optimizer update run right after the gradient it
    reads is final (ir/update_order.py), where that lowers the step's peak on options.backend;
    else in the traced order. `plans.update_order` says which was kept and both peaks.
    decided: the order the default plan kept, which a budget's plans follow (None: compare)."""
    plans = step_plans_narrowed(stage, options, log)
    if decided is None:
        decided = followed_update_order()
    if not early_updates_on() or not stage.inlined_gradients or decided is False:
        return plans  # (no gradient known: nothing can be said to follow one)
    graph = updates_after_gradients(
        stage.forward, stage.inlined_forward, stage.inlined_gradients, options.donated
    )
    if graph is None:
        return plans
    moved = replace(stage, forward=log.record("updates_after_gradients", graph))
    early = step_plans_narrowed(moved, options, log)
    order = UpdateOrder(options.backend, region_calls(plans), region_calls(early), decided)
    if order.kept:
        return replace(early, update_order=order)
    return replace(plans, update_order=order)


def _step_plans(
    stage: Stage, options: PipelineOptions, log: PassLog, made: dict | None = None
) -> RegionPlans:
    """A step with no backward of its own: one forward plan (layer_norm expanded; `made`, when
    given, gets each node of stage.forward -> the nodes standing for it in that plan)."""
    made = {} if made is None else made
    forward = _expanded(stage.forward, log, options.expand, made)
    return RegionPlans(
        _plan(forward, log, options.donated),
        None,
        [],
        stage.n_outputs,
        stage.wrt,
        log,
        inlined_forward=_inlined_after(stage, forward, made),
    )


def expand_backward(stage: Stage, options: PipelineOptions, log: PassLog) -> Stage:
    """A region's backward with tanh-gelu and layer_norm in primitives (with expand)."""
    if not options.expand:
        return stage
    bwd = cleanup(log.record("expand_tanh_gelu", expand_tanh_gelu(stage.backward)), log)
    bwd = cleanup(log.record("expand_layer_norm", expand_layer_norm(bwd)), log)
    return replace(stage, backward=bwd)


def order_saved_inputs(stage: Stage, log: PassLog) -> Stage:
    """The backward's inputs in the order the runtime passes them (saved_inputs_last)."""
    bwd = saved_inputs_last(stage.backward, stage.saved)
    return replace(stage, backward=log.record("saved_inputs_last", bwd))


def saved_inputs_last(backward: Graph, saved) -> Graph:
    """backward with its inputs ordered as the runtime passes them: cotangents, then one
    input per saved value, in the order of `saved`."""
    inputs = [v for v in backward.inputs if v.role != "saved"] + [s.backward_input for s in saved]
    graph = _with_outputs(backward, list(backward.outputs))
    graph.inputs = inputs
    return graph


def forward_returns_saved(stage: Stage, options: PipelineOptions, log: PassLog) -> RegionPlans:
    """The region's forward returning its outputs, then the saved values it computes (layer_norm
    expanded, the saved slots and recomputed rows moved onto the nodes standing for theirs);
    both plans given liveness."""
    graph, saved = stage.forward, stage.saved
    inputs = {v: i for i, v in enumerate(graph.inputs)}
    extra = [s.forward for s in saved if s.forward not in inputs and s.forward not in graph.outputs]
    made: dict[Value, list[Value]] = {}
    fwd = _expanded(_with_outputs(graph, graph.outputs + extra), log, options.expand, made)
    recomputed = [_moved(r, made) for r in stage.recomputed]
    slots = []
    for s in saved:
        if s.forward in inputs:
            slots.append(SavedSlot(("input", inputs[s.forward]), s.forward, s.reason))
        else:
            at = (graph.outputs + extra).index(s.forward)  # the same place after expanding
            slots.append(SavedSlot(("output", at), fwd.outputs[at], s.reason))
    return RegionPlans(
        _plan(fwd, log, options.donated),
        _plan(stage.backward, log),
        slots,
        stage.n_outputs,
        stage.wrt,
        log,
        recomputed,
    )


def narrow_saved(plans: RegionPlans, options: PipelineOptions, log: PassLog) -> RegionPlans:
    """With saved_dtype, the plans with the saved values their forward computes stored in that
    dtype (a bfloat16 round trip, ir/saved_dtype.py), planned again; kept in full precision
    where that does not lower the compiled plans' peak (forward, then a consuming backward):
    a float64 step's GEMMs read float64 copies of narrow saved values, and the forward's
    arena, held through backward(), takes the full-width values the saved buffers held (3
    square float32 layers of 64, 128 rows, bfloat16: 311,304 B against 294,928). What it did
    is `plans.narrowing` (ir/saved_dtype.py HeldNarrowing)."""
    if options.saved_dtype is None:
        return plans
    graph = plans.forward.graph
    forward, backward, slots = narrowed_saved(
        _with_outputs(graph, list(graph.outputs)),  # narrowed_saved changes its lists
        plans.backward.graph,
        plans.saved,
        plans.n_outputs,
        options.saved_dtype,
    )
    offered = sum(
        new.forward is not old.forward for new, old in zip(slots, plans.saved, strict=True)
    )
    if not offered:
        return plans
    forward = _plan(log.record("saved_dtype", forward), log, options.donated)
    backward = _plan(log.record("saved_dtype", backward), log)
    narrowed = replace(plans, forward=forward, backward=backward, saved=slots)
    for candidate in (plans, narrowed):  # before lowering: the lowering is kept with the plans
        mark_copied(candidate, options.copied)
    kept = _outputs_kept(plans)  # the same for both: it only moves where the peak falls
    peak = predicted_peak_bytes(region_calls(narrowed), kept=kept)
    full_peak = predicted_peak_bytes(region_calls(plans), kept=kept)
    if peak < full_peak:
        narrowing = HeldNarrowing(options.saved_dtype, offered, offered, peak, full_peak, peak)
        return replace(narrowed, narrowing=narrowing)
    narrowing = HeldNarrowing(
        options.saved_dtype, offered, 0, full_peak, full_peak, peak, alternative=narrowed
    )
    return replace(plans, narrowing=narrowing)


def _outputs_kept(plans: RegionPlans) -> int:
    """Bytes of the user's outputs a loop keeps bound while the next call's forward runs
    (report/loop_peak.py kept_output_bytes, for a function that returns them all): each
    output's own buffer once, not an input or a literal."""
    graph = plans.forward.graph
    seen, kept = set(), 0
    donated = [graph.inputs[i].type for i in plans.forward.donated]
    for value in graph.outputs[: plans.n_outputs]:
        if value.type in donated:  # passed back in: the next call's argument
            donated.remove(value.type)
            continue
        root = storage_root(value)
        if root in seen or root in graph.inputs or root.op in ("const", "full"):
            continue
        seen.add(root)
        kept += root.type.nbytes
    return kept


def joint_plan(stage: Stage, options: PipelineOptions, log: PassLog):
    """value_and_grad's plan, and with saved_dtype what it narrowed (narrowed_for_peak)."""
    full = _plan(stage.forward, log)
    if options.saved_dtype is None:
        return full, None
    full.copied = tuple(options.copied)  # before lowering: the lowering is kept with the plan

    def build(narrowed: Stage) -> Plan:
        plan = _plan(narrowed.forward, log)
        plan.copied = tuple(options.copied)
        return plan

    def peak(plan: Plan) -> int:
        return predicted_peak_bytes(joint_calls(plan, stage.n_outputs))

    return narrowed_for_peak(stage, options, log, full, build, peak, stored_values(lower(full)))


def step_plans_narrowed(stage: Stage, options: PipelineOptions, log: PassLog) -> RegionPlans:
    """A step with inlined gradients: its plans, with saved_dtype narrowed as narrowed_for_peak
    chooses (what it did in `plans.narrowing`)."""
    made: dict = {}
    full = _step_plans(stage, options, log, made)
    if options.saved_dtype is None:
        return full
    mark_copied(full, options.copied)  # before lowering: the lowering is kept with the plans

    def build(narrowed: Stage) -> RegionPlans:
        plans = _step_plans(narrowed, options, log)
        mark_copied(plans, options.copied)
        return plans

    def peak(plans: RegionPlans) -> int:
        return predicted_peak_bytes(region_calls(plans))

    stored = stored_values(lower(full.forward))
    stored = {v for v in stage.forward.nodes if made.get(v, [v])[-1] in stored}
    plans, narrowing = narrowed_for_peak(stage, options, log, full, build, peak, stored)
    return replace(plans, narrowing=narrowing)


def narrowed_for_peak(stage, options, log, full, build, peak, stored):
    """(the plan that runs, HeldNarrowing) for saved_dtype on a plan whose gradient part reads
    forward values (value_and_grad's, or a step's with inlined gradients): of every held value
    narrowed, only those the compiled plan in full precision stores (`stored`), or none, the
    one whose compiled peak is lowest (at equal peaks the fewer narrowed). A narrow copy of a
    value the compiled plan never stores (computed inside the loop that reads it for the
    gradient) is a buffer where there was none, and its cast splits that loop: a 6-tanh chain
    and its gradient, one loop storing nothing in full precision (512x256, 1,573,896 B),
    became a 2-stage row loop storing 16-bit copies (1,623,048 B). Chosen on the compiled
    plan's peak whichever backend runs it: the reference interpreter runs the same plan (the
    same values), though it stores every value. build: a narrowed stage -> its plans; peak:
    plans -> the compiled peak."""
    every = narrow_held(stage, options, log)
    offered = _narrowed_count(stage, every)
    if not offered:
        return full, None
    tried = [(peak(full), 0, full)]
    some = narrow_held(stage, options, log, stored)
    for narrowed in (every, some) if 0 < _narrowed_count(stage, some) < offered else (every,):
        plans = build(narrowed)
        tried.append((peak(plans), _narrowed_count(stage, narrowed), plans))
    best = min(tried, key=lambda t: (t[0], t[1]))
    lowest = min(t[0] for t in tried[1:])
    left = [] if best[1] == offered else _offered(stage, options)
    if 0 < best[1] < offered:
        left = [v for v in left if v not in stored]
    wide = wider_than(left, options.saved_dtype)
    narrowing = HeldNarrowing(
        options.saved_dtype, offered, best[1], best[0], tried[0][0], lowest, wide
    )
    return best[2], narrowing


def _offered(stage: Stage, options: PipelineOptions) -> list[Value]:
    """The held values of stage that saved_dtype could narrow (ir/saved_dtype.py narrowable)."""
    forward = stage.inlined_forward
    if options.joint:
        forward = forward_nodes(stage.forward, stage.n_outputs)
    held = held_across(stage.forward, forward)
    return narrowable(stage.forward, held, options.saved_dtype)


def _narrowed_count(stage: Stage, narrowed: Stage) -> int:
    """Held values narrowed: narrowed_joint adds two casts for each."""
    return (len(narrowed.forward.nodes) - len(stage.forward.nodes)) // 2


def narrow_held(
    stage: Stage, options: PipelineOptions, log: PassLog, stored: set[Value] | None = None
) -> Stage:
    """Joint (or a step with inlined gradients), with saved_dtype: the forward values the
    gradient part reads kept in that dtype between the two parts (a cast after each is made,
    one back before its first gradient reader: ir/saved_dtype.py narrowed_joint); with
    `stored`, only those in it."""
    if options.saved_dtype is None:
        return stage
    graph = stage.forward
    forward = stage.inlined_forward
    if options.joint:
        forward = forward_nodes(graph, stage.n_outputs)
    moved: dict = {}
    held = held_across(graph, forward)
    narrowed = narrowed_joint(graph, forward, held, options.saved_dtype, moved, stored)
    stage = replace(stage, forward=log.record("saved_dtype", narrowed))
    if options.joint or not moved:
        return stage
    return replace(stage, inlined_forward=frozenset(moved.get(n, n) for n in forward))


def held_schedule(stage: Stage, joint: bool) -> StepSchedule:
    """The memory planner's view of what the gradients hold: the nodes in run order, those
    of the gradient part marked (a region's saved inputs stand for their forward values)."""
    if joint or stage.backward is None:  # one plan: value_and_grad's, or a training step's
        graph = stage.forward
        forward = stage.inlined_forward
        if joint:
            forward = forward_nodes(graph, stage.n_outputs)
        later = {n for n in graph.nodes if n not in forward}
        return step_schedule(graph.nodes, later, graph.outputs, graph.inputs)
    fwd, bwd = stage.forward, stage.backward
    alias = {s.backward_input: s.forward for s in stage.saved}
    inputs = fwd.inputs + [v for v in bwd.inputs if v not in alias]
    return step_schedule(
        fwd.nodes + bwd.nodes,
        set(bwd.nodes),
        fwd.outputs + bwd.outputs,
        inputs,
        alias,
        two_plans=True,
    )


# ---- helpers -----------------------------------------------------------------------------------


def read_saved(backward: Graph, saved: list) -> list:
    """The saved values backward still reads after cleanup (others were simplified away)."""
    used = {i for node in backward.nodes for i in node.inputs} | set(backward.outputs)
    return [s for s in saved if s.backward_input in used]


def _expanded(forward: Graph, log: PassLog, expand: bool, made: dict | None = None) -> Graph:
    """The forward with layer_norm expanded, without cleanup: `made` maps each old node to the
    nodes standing for it, which the saved slots and the recomputed rows are moved onto."""
    if not expand:
        return forward
    return log.record("expand_layer_norm", expand_layer_norm(forward, made))


def _inlined_after(stage: Stage, graph: Graph, made: dict) -> frozenset | None:
    """A step's inlined forward part (with the saved_dtype casts after it) as the nodes of
    graph, its plan's graph after expanding (`made`: old node -> the nodes standing for it)."""
    if stage.inlined_forward is None:
        return None
    forward = set(stage.inlined_forward)
    forward.update(n for n in stage.forward.nodes if is_saved_narrowing(n, forward))
    nodes = set(graph.nodes)
    return frozenset(new for old in forward for new in made.get(old, [old]) if new in nodes)


def _moved(recomputed: Recomputed, made: dict) -> Recomputed:
    if not made:  # nothing was expanded: the same nodes
        return recomputed
    chain = tuple(n for old in recomputed.chain for n in made[old])
    return replace(recomputed, forward=made[recomputed.forward][-1], chain=chain)


def _with_outputs(graph: Graph, outputs: list[Value]) -> Graph:
    """The same nodes in a new graph (lists copied: the caller's own are never changed)."""
    new = Graph(graph.name, list(graph.inputs), list(graph.nodes), outputs, dict(graph.constants))
    return carry_reasons(graph, new)


def mark_copied(plans: StepPlans, copied: tuple) -> None:
    """Say on each plan of the step which of its inputs arrive in another layout than C order
    (Plan.copied): the forward's (or joint plan's) `copied` inputs, and the backward's saved
    inputs that are those arrays (the caller's own, read again when backward() runs)."""
    copied = tuple(copied)
    if isinstance(plans, JointPlans):
        _mark(plans.plan, copied)
        return
    _mark(plans.forward, copied)
    if plans.backward is not None:
        layouts = dict(copied)
        n_cot = plans.n_cotangents
        _mark(
            plans.backward,
            tuple(
                (n_cot + slot, layouts[s.source[1]])
                for slot, s in enumerate(plans.saved)
                if s.source[0] == "input" and s.source[1] in layouts
            ),
        )


def _mark(plan: Plan, copied: tuple) -> None:
    """plan.copied = copied, and any lowering made before (a peak compared while planning:
    narrow_saved) let go: it read the inputs as C-ordered arrays."""
    if plan.copied != copied:
        plan.copied = copied
        plan.lowered.clear()


def _plan(graph: Graph, log: PassLog, donated: tuple[int, ...] = ()) -> Plan:
    """Liveness: the step that makes a plan (the frees), with the inputs it may donate."""
    plan = plan_liveness(graph, donated)
    if log.verify:
        verify_plan(plan)
    if log.echo:
        print(f"--- plan\n{plan.text()}", file=sys.stderr)
    return plan
