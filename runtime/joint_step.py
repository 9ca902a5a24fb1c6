"""One plan per step for a small compiled loss that backward() follows.

`loss = step(params, x); loss.backward()` runs two plans (the forward, then the backward reading
saved buffers), each with its own call's Python; value_and_grad runs one joint plan. For a small
step that Python is most of the time (mlp_tiny: 2x the joint plan's step). So a compiled
function whose loss is a float scalar and whose step is small learns, over its first calls,
whether each call's loss is backward()ed from the default seed (ones, without retain_graph). Once
it has seen that CALLS_TO_LEARN times, a call runs the joint plan instead: the loss now, the
gradients kept in the call's region (a JointRegion), which backward() hands to the leaves as
the backward plan would have computed them. Anything else (another seed, retain_graph, a call
whose loss is never backward()ed, an evaluation call between training steps) sends the next
calls back to two plans until CALLS_TO_LEARN in a row fit again; such a backward() of a joint
call recomputes the saved buffers from the call's inputs (held, read-only) and runs the backward
plan, so results never depend on the guess. BACKPLAN_JOINT_STEP=0 keeps every call on two plans.
"""

from __future__ import annotations

import os
import threading

import numpy as np

from backplan.ir.flops import node_flops
from backplan.ir.lowering import BackwardMode
from backplan.ir.pipeline import PipelineOptions, plan_choices
from backplan.ir.plans import RegionPlans
from backplan.ir.types import is_float

from .backend import current_backend, runner_for
from .engine import leaf_grads_lock
from .freed import freed_error
from .memory import track as _track
from .program import RegionProgram
from .region import FreedBy, LeafEdges, Region, _RLock, location_text

CALLS_TO_LEARN = 2  # split calls backward()ed from the default seed before the joint plan runs
JOINT_FROM_CALL = CALLS_TO_LEARN + 1  # the first call that runs the joint plan (explain says so)
# Steps above this many FLOPs keep two plans: their extra Python is under ~1% of the step, and
# the joint plan would be one more plan to compile.
MAX_STEP_FLOPS = 16_000_000
CONSUME = BackwardMode.CONSUME
NO_COPIES = frozenset()
_new_freed_by = object.__new__


def joint_step_for(graph, plans: RegionPlans, options: PipelineOptions, background):
    """A JointStep for a compiled function's traced graph, or None where it cannot stand in
    for the two plans: more than one output, a loss that is not a float scalar, donated
    inputs, a saved-bytes budget, or a step above MAX_STEP_FLOPS."""
    if os.environ.get("BACKPLAN_JOINT_STEP", "1").strip() == "0":
        return None
    if plans.backward is None or plans.n_outputs != 1 or options.donated:
        return None
    if options.saved_bytes_budget is not None:
        return None
    loss = plans.forward.graph.outputs[0]
    if loss.shape != () or not is_float(loss.dtype):
        return None
    nodes = plans.forward.graph.nodes + plans.backward.graph.nodes
    if sum(node_flops(n) for n in nodes) > MAX_STEP_FLOPS:
        return None
    wrt = list(plans.wrt)  # the inputs the region's edges stand for, in the same order
    joint = PipelineOptions(
        joint=True, remat=options.remat, saved_dtype=options.saved_dtype, copied=options.copied
    )
    return JointStep(lambda: plan_choices(graph, wrt, joint).build().plan, background)


def default_seed(cotangents: dict, mode: BackwardMode) -> bool:
    """backward() without arguments on the loss: one cotangent, exactly 1, consuming."""
    if mode is not CONSUME or len(cotangents) != 1:
        return False
    seed = cotangents.get(0)
    return seed is not None and seed.shape == () and seed.item() == 1


class JointStep:
    """What one compiled signature has learned about its calls, and its joint plan (built on
    first use). Calls from several threads only race on the guess, never on a result: each
    region holds its own gradients and inputs."""

    def __init__(self, build_plan, background: bool | None):
        self._build_plan = build_plan
        self.background = background
        self._plan = None
        self._runners: dict = {}
        self._building = threading.Lock()
        self.seen = 0  # calls in a row whose loss backward() took from the default seed
        self._expecting = False  # the last call's backward() has not come yet
        self._split_idle = False  # the two plans' idle arenas were freed for the joint plan

    def observe(self, cotangents: dict, mode: BackwardMode) -> None:
        """A call's backward(): one more in a row that fits, or a new start."""
        self.fits(default_seed(cotangents, mode))

    def fits(self, fitting: bool) -> None:
        self._expecting = False
        self.seen = self.seen + 1 if fitting else 0

    def take_over_before_copies(self, program) -> None:
        """Free the two plans' idle arenas now if this call is the one the joint plan takes
        over (run would free them): a call copying NumPy arguments makes its copies before
        run, and explain counts the copies beside the joint plan's arena, not the two plans'."""
        if not self._expecting and self.seen >= CALLS_TO_LEARN and not self._split_idle:
            program.release_idle()
            self._split_idle = True

    def runners(self) -> list:
        """The joint plan's runners made so far (one per backend)."""
        return list(self._runners.values())

    def plan(self):
        if self._plan is None:
            with self._building:
                if self._plan is None:
                    self._plan = self._build_plan()
        return self._plan

    def run(self, program: RegionProgram, args: list, edges: list, loc, copies=frozenset()):
        """(outputs, region) of one call through the joint plan once CALLS_TO_LEARN calls in
        a row fitted; None (run the two plans) before, and after a call whose loss was never
        backward()ed."""
        if self._expecting:
            self.seen = 0
        self._expecting = True
        if self.seen < CALLS_TO_LEARN:
            self._split_idle = False  # the two plans run: their arenas are in use again
            return None
        if not self._split_idle:  # the joint plan takes over: the two plans' arenas go
            program.release_idle()
            self._split_idle = True
        try:  # made once per backend, then looked up (a subscript: .get is a method call)
            runner = self._runners[current_backend()]
        except KeyError:
            runner = runner_for(self.plan(), self._runners, self.background)
        results = runner(list(args))
        return results[:1], JointRegion(program, args, results[1:], edges, loc, self, copies)


class JointRegion(Region):
    """A region whose gradients the joint plan computed with the forward: backward() from the
    default seed takes them as they are; any other backward() recomputes the saved buffers
    from the inputs it holds and runs the region's backward plan. It holds no saved buffer
    (its table says not held): the gradients and its inputs wait instead, and live_saved_bytes
    counts them."""

    ready = True  # until backward() takes the gradients or frees the region
    freed_by = None
    backward_calls = 0

    def __init__(self, program, args, grads, edges, loc, step: JointStep, copies=NO_COPIES):
        # Region.__init__'s fields, set here (once a step; freed_by, backward_calls and ready
        # start as the class's): nothing is saved, so _saved starts empty
        self.program = program
        self.copies = copies
        self.name = program.name
        self._made_at = loc
        self._edges = edges
        self._saved = {}
        self.lock = _RLock()
        self._args = args
        self._grads = grads
        self._step = step
        _track(self)

    def run_backward(self, cotangents: dict, mode: BackwardMode) -> list:
        grads = self._grads
        fitting = grads is not None and default_seed(cotangents, mode)
        self._step.fits(fitting)
        if fitting:
            self._grads, self.ready = None, False
            self.backward_calls += 1
            return grads
        # the gradients of the default seed are not these: dropped before the forward reruns,
        # so the call holds what a call on two plans holds (explain's fallback peak)
        self._grads = grads = None
        if not self._saved and self._args is not None:
            self._saved = dict(enumerate(self._recomputed_saved()))
        return super().run_backward(cotangents, mode)

    def hand_over(self, loc, index: int) -> bool:
        """backward() at loc from the default seed of output `index`: the gradients the joint
        plan computed go to the leaves (once per leaf, a leaf passed twice summed) and the
        region is freed by that backward(); True. False, changing nothing, when they are not
        here or some input is not a leaf (backward() runs the engine then). One call, once
        per training step: the checks, the hand-over and the freeing are all here."""
        with self.lock:  # two threads' backward() of one loss: one takes them, one raises
            if self.freed_by is not None:
                raise freed_error([self], self, index, location_text(loc))
            grads = self._grads
            if grads is None:
                return False
            leaves = self._edges
            if type(leaves) is not LeafEdges:  # Edge objects: made by a read, or not a leaf
                leaves = [edge.leaf for edge in leaves]
                if any(leaf is None for leaf in leaves):
                    return False
            # a leaf passed twice: its gradients sum. Tensors hash by identity (object.__hash__:
            # equal hashes are one object, so == never runs): half the cost of a set of ids
            if len({*leaves}) != len(leaves):
                leaves, grads = _summed_per_leaf(leaves, grads)
            step = self._step  # step.fits(True), inline
            step._expecting = False
            step.seen += 1
            self._grads = self._args = None  # mark_freed's, inline: nothing was saved
            self.ready = False
            self.backward_calls += 1
            # FreedBy(loc, self, index, own=True), its fields set here: one output, the root
            by = self.freed_by = _new_freed_by(FreedBy)
            by._where, by._root_name, by._root_output = loc, self.name, None
            by._root_made, by.root_ref, by.failed = self._made_at, None, False
            with leaf_grads_lock:  # the leaves are tensors: one call adds a step's gradients
                if leaves:
                    leaves[0]._add_joint_grads(leaves, grads)
        return True

    def held_arrays(self) -> list:
        """While its gradients wait for backward(), what the region holds for it is those
        gradients (allocated by the joint plan) and the inputs it would recompute from (yours
        where you passed them): live_saved_bytes counts these, not saved buffers it never had."""
        grads, args = self._grads, self._args
        if grads is None or args is None:
            return super().held_arrays()
        held = [(g, False) for g in grads if isinstance(g, np.ndarray)]
        return held + [
            (a, self._is_yours(("input", i)))
            for i, a in enumerate(args)
            if isinstance(a, np.ndarray)
        ]

    def buffer_state(self, buffer) -> str:
        """Before backward(), with the gradients waiting, a buffer was never held (the joint
        plan read it and dropped it), not freed by a backward()."""
        if buffer.freed and self._grads is not None and not self.freed:
            return "not held (joint plan)"
        return super().buffer_state(buffer)

    def _recomputed_saved(self) -> list:
        program, args = self.program, self._args
        outputs = program.run_forward(list(args))
        return [args[i] if from_input else outputs[i] for from_input, i in program.saved_sources]

    def mark_freed(self, by) -> None:
        super().mark_freed(by)
        self._grads = self._args = None
        self.ready = False

    def __repr__(self) -> str:
        waiting = " (gradients computed with the forward, one joint plan)" if self._grads else ""
        return super().__repr__()[:-1] + waiting + ">"


def _summed_per_leaf(leaves: list, grads: list) -> tuple[list, list]:
    """(leaves, gradients) with each leaf once, the gradients of a leaf passed twice summed."""
    by_leaf: dict = {}
    for leaf, grad in zip(leaves, grads, strict=True):
        held = by_leaf.get(id(leaf))
        by_leaf[id(leaf)] = (leaf, grad if held is None else held[1] + grad)
    return [leaf for leaf, _ in by_leaf.values()], [grad for _, grad in by_leaf.values()]
