"""@compile: trace a function once per signature into a region program, then run the plans."""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from operator import itemgetter
from typing import Any, overload

import numpy as np

from backplan.ir.errors import MemoryBudgetError
from backplan.ir.gc_pause import paused_gc
from backplan.ir.pipeline import PipelineOptions, plan_choices
from backplan.ir.symbolic_regions import fit_regions
from backplan.ir.types import dtype_name, is_float
from backplan.report.argument_copies import mark_argument_copies, numpy_inputs, numpy_saved_inputs
from backplan.runtime import RegionProgram, is_grad_enabled
from backplan.runtime.backend import current_backend
from backplan.runtime.execute import run_forward
from backplan.runtime.joint_step import joint_step_for
from backplan.runtime.region import LeafEdges

from .arguments import ArgumentSpec
from .budget import BudgetPlanner, checked_budget, nested_budget_refusal
from .captured_names import captured_names
from .donate import (
    check_donated_inputs,
    donatable,
    mark_donated,
    release_donated,
    unmark_donated,
)
from .dynamic import checked_dynamic, sizes_planned_apart
from .fastpath import positions_of
from .float_checks import float_checks_of, run_float_checks
from .numpy_args import call_copies, input_tensor, kept_by_outputs, reference_copies
from .planned import (  # noqa: F401  (CacheInfo, RetraceWarning: public)
    DEFAULT_CACHE_SIZE,
    STALE,
    CacheInfo,
    PlannedFunction,
    RetraceWarning,
    check_background,
)
from .pytree import TreeDef, flatten, unflattener
from .reports import explain_traced
from .saved_dtype_check import check_saved_dtype_narrows
from .signature import bind_call, closest_key, copied_leaves, miss_reason, numpy_apart
from .source import loc_text, user_frame_loc
from .tensor import Tensor
from .trace import Trace, tracing
from .traced_size import plain


@dataclass
class TracedFunction:
    """One signature's trace: its graph inputs are the call's tensors, then captured tensors."""

    program: RegionProgram
    out_treedef: TreeDef
    out_slots: list  # per output leaf: ("tensor", output index) or ("static", value)
    captured: list[Tensor]
    captured_flags: tuple[bool, ...]
    input_names: list[str]  # one per graph input: argument paths, then captured tensors
    donated: tuple[int, ...] = ()  # graph inputs of donated arguments
    donated_to: str = ""  # "step() (bp.compile(donate_argnums=(0, 1)))", for the error
    planner: BudgetPlanner | None = None  # the plans this signature could run instead
    inner_joints: tuple = ()  # report.InnerJoint: value_and_grad plans inlined into this one
    float_checks: tuple = ()  # (input, argument, check) of traced floats: float_checks.py
    rebuild_outputs: Callable = field(init=False, repr=False)  # out_treedef's unflattener
    grad_inputs: tuple[int, ...] = field(init=False, repr=False)  # inputs a gradient flows to
    every_input_grad: bool = field(init=False, repr=False)  # grad_inputs is every input
    # the call's tensors -> those at grad_inputs, in one C call (a comprehension makes a
    # function and a frame each call: ~1,500 instructions of a compiled step's ~40,000)
    pick_grad_inputs: Callable = field(init=False, repr=False)
    one_output: bool = field(init=False, repr=False)  # returns output 0 as it is (a loss)
    unread_donated: frozenset = field(init=False, repr=False)  # donated inputs no node reads

    def __post_init__(self):
        self.rebuild_outputs = unflattener(self.out_treedef)
        self.unread_donated = _unread(self.program.plans.forward.graph, self.donated)
        wrt = self.program.plans.wrt
        self.grad_inputs = tuple(i for i, w in enumerate(wrt) if w)
        self.every_input_grad = len(self.grad_inputs) == len(wrt)
        first = self.grad_inputs[0] if self.grad_inputs else 0  # one: a slice keeps a list
        self.pick_grad_inputs = (
            itemgetter(*self.grad_inputs)
            if len(self.grad_inputs) > 1
            else itemgetter(slice(first, first + 1))
        )
        self.one_output = self.out_treedef.kind == "leaf" and self.out_slots == [("tensor", 0)]

    def runners(self) -> list:
        return self.program.runners()


def _unread(graph, positions) -> frozenset:
    """The graph inputs at positions that no node and no output of graph reads (the forward
    plan: a backward or joint plan reads only inputs the forward reads)."""
    if not positions:
        return frozenset()
    read = set(graph.outputs)
    for node in graph.nodes:
        read.update(node.inputs)
    return frozenset(i for i in positions if graph.inputs[i] not in read)


def trace_function(fn, name: str, call) -> tuple[Trace, list, TreeDef]:
    """Run fn on tracers; returns the trace, output leaves and output structure."""
    trace = Trace(name)
    leaves = list(call.leaves)
    for pos, key in zip(
        call.tensor_positions, [call.key.leaves[p] for p in call.tensor_positions], strict=True
    ):
        value = trace.graph.add_input(_type_of(leaves[pos]))
        leaves[pos] = Tensor._traced(value, trace, key.requires_grad, weak=key.weak)
        if key.weak:
            trace.floats[value] = call.arguments[pos]
    with tracing(trace):
        result = call.call(fn, leaves)
    out_leaves, out_treedef = flatten(result)
    return trace, out_leaves, out_treedef


def _type_of(tensor):
    from backplan.ir.types import TensorType

    return TensorType(tensor._ir_dtype, tensor.shape)


def run_traced(traced: TracedFunction, call, record: bool = True):
    """Run one signature's forward plan on the call's tensors. With record (and some input
    needing a gradient) outputs point at a Region holding the saved buffers, so .backward()
    works. Loaded artifacts run through here too, so both paths build regions the same way."""
    tensors = [call.leaves[p] for p in call.tensor_positions]
    copies = NONE  # a loaded artifact's call keeps no sources: its copies are not told apart
    if call.sources:  # NumPy arguments: those the backward reads are copies the region holds
        copies = numpy_inputs(call) & _saved_inputs(traced.program)
        if call.borrowed:  # views of the caller's arrays: copied where they outlive the call
            tensors = _owned_where_kept(traced, call, tensors)
    return run_tensors(traced, tensors, record, copies=copies)


def _owned_where_kept(traced: TracedFunction, call, tensors: list) -> list:
    """The first call's tensors with each NumPy argument bind_call wrapped as a view copied
    where the fast path copies it (input_slots): the same buffers as every later call."""
    sources = [call.sources[p] for p in call.tensor_positions]
    slots = input_slots(traced, sources, current_backend() == "reference")
    owned = list(tensors)
    for k, p in enumerate(call.tensor_positions):
        if p in call.borrowed and slots[k]:
            owned[k] = input_tensor(sources[k], slots[k])
            if tensors[k].requires_grad:  # a loaded function's stand-in (artifacts/loaded.py)
                owned[k].requires_grad = True
    return owned


def input_slots(traced: TracedFunction, leaves: list, reference: bool) -> list:
    """Per graph input passed as `leaves` (the fast path's, in the plan's order): the copy
    input_array makes of a NumPy one (tracer/numpy_args.py): True (C order: a donated buffer,
    outputs are written into it; on the reference interpreter an array not in C order that a
    reshape reads), "K" (its own order: saved for backward, or read by an output), or False
    (borrowed: read where it is)."""
    program = traced.program
    kept = _kept_inputs(program, traced.donated, reference)
    if reference:
        graph = program.plans.forward.graph
        return [
            True if copy and k in traced.donated else copy
            for k, copy in enumerate(reference_copies(graph, kept, leaves))
        ]
    return [
        (True if k in traced.donated else "K") if k in kept else False for k in range(len(leaves))
    ]


def run_tensors(
    traced: TracedFunction, tensors: list, record: bool = True, skip: int = 0, copies=frozenset()
):
    """run_traced on the graph inputs. skip: how many frames, this one first, are backplan's
    own by construction (the fast path's fixed chain of calls, PlannedFunction.__call__ or a
    wrapper of the runner last); the user line's walk passes over them. copies: inputs that
    are copies of the caller's NumPy arrays, taken for this call (the region holds them)."""
    if traced.float_checks:
        run_float_checks(traced.float_checks, tensors, traced.program.name)
    if traced.captured:
        tensors = tensors + traced.captured
    program = traced.program
    grad_inputs = traced.grad_inputs
    edges = loc = None
    if record and grad_inputs:
        edges = edges_of(tensors if traced.every_input_grad else traced.pick_grad_inputs(tensors))
    if edges is not None or traced.donated:
        loc = user_frame_loc(skip)  # the region's and the donation's line; text made on demand
    donate = ()
    if traced.donated:
        donate = donatable(tensors, traced.donated, traced.unread_donated)
        mark_donated(tensors, traced, loc_text(loc))
        try:
            outputs, region = run_forward(
                program, [t._data for t in tensors], edges, loc, donate, copies
            )
        except BaseException:
            unmark_donated(tensors, traced)
            raise
        release_donated(tensors, traced)
    else:
        outputs, region = run_forward(
            program, [t._data for t in tensors], edges, loc, donate, copies
        )
    grads = program.differentiable_outputs
    if traced.one_output:  # a loss: no containers to rebuild
        grad_fn = region if region is not None and 0 in grads else None
        return Tensor._from_array(outputs[0], grad_fn)
    leaves = []
    for kind, item in traced.out_slots:
        if kind == "static":
            leaves.append(item)
        elif region is not None and item in grads:
            leaves.append(Tensor._from_array(outputs[item], grad_fn=region, out_index=item))
        else:
            leaves.append(Tensor._from_array(outputs[item]))
    return traced.rebuild_outputs(leaves)


def edges_of(tensors: list):
    """The region's edges: the tensors themselves (LeafEdges, made into Edge objects only if
    something reads them) when every one is a leaf, as a training step's parameters are."""
    for tensor in tensors:
        if tensor._grad_fn is not None:
            return [t._edge() for t in tensors]
    return LeafEdges(tensors)


class CompiledFunction(PlannedFunction):
    """See `compile`."""

    def __init__(
        self,
        fn,
        remat: bool = True,
        saved_bytes_budget: int | None = None,
        static_argnums=(),
        static_argnames=(),
        donate_argnums=(),
        cache_size: int = DEFAULT_CACHE_SIZE,
        background: bool | None = None,
        max_peak_bytes: int | None = None,
        saved_dtype=None,
        dynamic=None,
        allow_saved_dtype=None,
    ):
        super().__init__(fn, cache_size, background)
        self.remat = remat
        self.saved_dtype, self.allow_saved_dtype = checked_saved_dtypes(
            saved_dtype, allow_saved_dtype
        )
        self.saved_bytes_budget = checked_budget(saved_bytes_budget, "saved_bytes_budget")
        self.max_peak_bytes = checked_budget(max_peak_bytes, "max_peak_bytes")
        if self.saved_bytes_budget is not None and self.max_peak_bytes is not None:
            raise ValueError(
                "give max_peak_bytes (the whole step's peak) or saved_bytes_budget (the bytes "
                "held for backward), not both"
            )
        self.arguments = ArgumentSpec(fn, static_argnums, static_argnames, donate_argnums)
        self._dynamic = checked_dynamic(dynamic, _parameter_names(fn))
        budget = max_peak_bytes is not None or saved_bytes_budget is not None
        if self._dynamic and budget:
            raise ValueError(
                "dynamic= with a memory budget: which plan fits a budget depends on the size; "
                "give one or the other"
            )
        self._auto_dynamic = dynamic is None and not budget
        if dynamic is None and budget:
            option = "max_peak_bytes" if max_peak_bytes is not None else "saved_bytes_budget"
            self._sizes_apart = sizes_planned_apart(option)
        self._static_nums = self.arguments.static_nums
        self._static_names = self.arguments.static_names
        functools.update_wrapper(self, fn, updated=())  # not fn.__dict__: ours

    def _call_in_trace(self, args, kwargs):
        """Nested compiled functions inline into the enclosing plan, which is planned as a
        whole: a budget of this one's would silently not hold there, so it is refused."""
        budget = compiled_budget_words(self)
        if budget is not None:
            raise MemoryBudgetError(nested_budget_refusal(self.fn, budget))
        return self.fn(*args, **kwargs)

    def with_budget(self, max_peak_bytes: int) -> CompiledFunction:
        """The same function compiled with another max_peak_bytes (bp.max_batch asks): the
        same options, an empty cache."""
        other = copy.copy(self)
        PlannedFunction.__init__(other, self.fn, self.cache_size, self.background)
        other._static_nums, other._static_names = self._static_nums, self._static_names
        other.saved_bytes_budget = None
        other.max_peak_bytes = checked_budget(max_peak_bytes, "max_peak_bytes")
        return other

    def batch_leaf(self, position: int, leaf) -> bool:
        """Whether a leaf of argument `position` is data with a batch axis, not a parameter:
        what bp.max_batch resizes by default (tensors that need no gradient, arrays). A donated
        argument is the parameters and optimizer state a training step updates, never data."""
        if position in self._static_nums or position in self.arguments.donate_nums:
            return False
        return not getattr(leaf, "requires_grad", False)

    def _bind(self, args, kwargs):
        call = bind_call(self.fn, args, kwargs, self._static_names)
        if self.max_peak_bytes is None and self.saved_bytes_budget is None:
            return call
        return numpy_apart(call)  # the budget holds for the kind of array each call passes

    def _still_valid(self, traced: TracedFunction) -> bool:
        return _captured_flags(traced.captured) == traced.captured_flags

    def _miss_reason(self, key, stale: TracedFunction | None) -> str | None:
        if stale is not None:
            return "requires_grad of a captured tensor changed"
        cached = tuple(self._entries)  # one step under the GIL: other threads may move keys
        return miss_reason(closest_key(cached, key, self._last_key), key)

    def _run(self, traced: TracedFunction, call):
        return run_traced(traced, call)

    def _fast_runner(self, traced: TracedFunction, call, leaves: list):
        positions = positions_of([call.sources[p] for p in call.tensor_positions], leaves)
        if positions is None:
            return None

        picked = [leaves[i] for i in positions]
        # a donated copy in C order (outputs are written into it), any other in its own
        slots = list(zip(positions, input_slots(traced, picked, False), strict=True))
        interpreted = list(zip(positions, input_slots(traced, picked, True), strict=True))
        as_given = positions == list(range(len(leaves))) and all(
            type(leaf) is Tensor for leaf in leaves
        )  # the leaves are the plan's input tensors, in order: nothing to pick or wrap
        captured = bool(traced.captured)
        saved = _saved_inputs(traced.program)
        # inputs a NumPy argument reaches as a copy the region holds (saved for backward)
        copy_slots = [(k, i) for k, (i, copy) in enumerate(slots) if copy and k in saved]
        joint = traced.program.joint_step
        record = bool(traced.grad_inputs)  # run_tensors records a region: the joint plan may run

        def run(leaves):
            if captured and not self._still_valid(traced):
                return STALE
            # only PlannedFunction.__call__ calls this (itself, or through _switching): the
            # user line's walk passes over run_tensors, run and the frame that called run
            if as_given:
                return run_tensors(traced, leaves, skip=3)
            if copy_slots and joint is not None and record:  # the copies come before run:
                joint.take_over_before_copies(traced.program)  # a joint plan frees arenas first
            chosen = interpreted if current_backend() == "reference" else slots
            tensors = [input_tensor(leaves[i], copy) for i, copy in chosen]
            copies = NONE
            if copy_slots:
                copies = frozenset(k for k, i in copy_slots if type(leaves[i]) is np.ndarray)
            return run_tensors(traced, tensors, skip=3, copies=copies)

        return run

    def _planner(self, entry: TracedFunction, call):
        """The planner counting the copies this call's NumPy arguments take: a function
        without a budget runs one plan for tensors and arrays, first called with either."""
        return entry.planner.for_numpy_inputs(numpy_inputs(call))

    def _report(self, traced: TracedFunction, call):
        report = explain_traced(traced, self.cache_info())
        copies = numpy_saved_inputs(traced.program, call)  # copied at the call: backplan's
        mark_argument_copies(report, traced.program, copies, *region_copies(traced, call))
        return report

    def _fit(self, entries: list[TracedFunction], sizes: list[int]):
        return fit_regions([e.program.plans for e in entries], sizes)

    def _instantiate(self, template: TracedFunction, fitted, size: int) -> TracedFunction:
        """The signature's entry at another size: the fitted plans instantiated, no trace."""
        program = template.program
        plans = RegionProgram(
            fitted.at(size),
            name=program.name,
            input_names=program.input_names,
            background=self.background,
        )
        return replace(template, program=plans, planner=None)

    def _build(self, call) -> TracedFunction:
        name = getattr(self.fn, "__name__", "compiled")
        trace, out_leaves, out_treedef = trace_function(self.fn, name, call)
        graph = trace.graph
        outputs, out_slots = [], []
        for leaf in out_leaves:
            if isinstance(leaf, Tensor):
                out_slots.append(("tensor", len(outputs)))
                outputs.append(trace.value_of(leaf))
            else:
                out_slots.append(("static", plain(leaf)))  # a size read: its int at this size
        graph.outputs = outputs
        captured_flags = _captured_flags(trace.captured)
        wrt = [call.key.leaves[p].requires_grad for p in call.tensor_positions] + list(
            captured_flags
        )
        names = [call.key.leaves[p].path for p in call.tensor_positions]
        names += captured_names(self.fn, trace.captured)
        donated = tuple(
            i
            for i, p in enumerate(call.tensor_positions)
            if call.arguments[p] in self.arguments.donate_names and not call.key.leaves[p].weak
        )
        check_donated_inputs(names, donated, wrt)
        # saved_bytes_budget is met by the planner (fit_saved), not by stopping the cheap
        # recomputation early: that gave plans outside the planner's monotone chain
        options = PipelineOptions(
            remat=self.remat,
            saved_dtype=self.saved_dtype,
            donated=donated,
            backend="reference" if current_backend() == "reference" else "numba",
            copied=copied_leaves(call),
        )
        input_bytes = sum(v.type.nbytes for v in graph.inputs)
        with paused_gc():  # ir/gc_pause.py: the pipeline's objects, no garbage to look for
            choices = plan_choices(
                graph, wrt, options, inlined=trace.inlined_losses, gradients=trace.inlined_gradients
            )
            check_saved_dtype_narrows(choices, (self.saved_dtype, self.allow_saved_dtype), name)
            planner = BudgetPlanner(choices, input_bytes, name, self.allow_saved_dtype)
            planner.numpy_inputs = numpy_inputs(call)  # each copied where a backward reads it
            planner.inlined = [joint.loc for joint in trace.inner_joints]
            plans = self._plans_within_budget(planner)
        program = RegionProgram(plans, name=name, input_names=names, background=self.background)
        if self.max_peak_bytes is None and self.saved_bytes_budget is None:  # a budgeted step
            # keeps the plans the budget chose
            program.joint_step = joint_step_for(graph, plans, options, self.background)
        return TracedFunction(
            program,
            out_treedef,
            out_slots,
            trace.captured,
            captured_flags,
            names,
            donated,
            f"{name}() (bp.compile(donate_argnums={self.arguments.donate_nums}))",
            planner,
            tuple(trace.inner_joints),
            float_checks_of(trace),
        )

    def _plans_within_budget(self, planner: BudgetPlanner):
        """The default plans, or under a budget the cheapest that fit it (or a refusal)."""
        if self.max_peak_bytes is not None:
            return planner.fit_peak(self.max_peak_bytes)
        plans = planner.build()
        if self.saved_bytes_budget is not None:
            return planner.fit_saved(self.saved_bytes_budget, plans)
        return plans


def compiled_budget_words(fn: CompiledFunction) -> str | None:
    if fn.max_peak_bytes is not None:
        return f"max_peak_bytes={fn.max_peak_bytes:,}"
    if fn.saved_bytes_budget is not None:
        return f"saved_bytes_budget={fn.saved_bytes_budget:,}"
    return None


def _parameter_names(fn) -> list[str] | None:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


def checked_saved_dtype(dtype) -> str | None:
    """The IR name of a saved_dtype: a float dtype (bp.bfloat16, bp.float16, ...), or None."""
    if dtype is None:
        return None
    name = dtype_name(dtype)
    if not is_float(name):
        raise ValueError(
            f"saved_dtype={dtype!r}: saved buffers are stored in a float dtype, e.g. bp.bfloat16"
        )
    return name


def checked_saved_dtypes(saved_dtype, allow_saved_dtype) -> tuple[str | None, str | None]:
    """saved_dtype (always) and allow_saved_dtype (when a budget needs it) as IR names; one
    of the two at most."""
    if saved_dtype is not None and allow_saved_dtype is not None:
        raise ValueError(
            "give saved_dtype (saved buffers always in that dtype) or allow_saved_dtype (the "
            "memory planner may choose it to meet a budget), not both"
        )
    return checked_saved_dtype(saved_dtype), checked_saved_dtype(allow_saved_dtype)


def _kept_inputs(
    program: RegionProgram, donated: tuple[int, ...], reference: bool = False
) -> set[int]:
    """Forward inputs whose buffer outlives the call: read by an output (in the compiled
    plan's buffers, or NumPy's on the reference interpreter), saved for backward, or donated.
    A NumPy array passed there is copied (tracer/numpy_args.py)."""
    graph = program.plans.forward.graph
    return kept_by_outputs(graph, reference) | _saved_inputs(program) | set(donated)


NONE = frozenset()


def region_copies(traced: TracedFunction, call) -> tuple[frozenset, frozenset]:
    """(kept, during) copies of the call's NumPy arguments for the forward plan on the
    backend running now (numpy_args.call_copies): what explain counts beside the saved ones."""
    if not call.sources:
        return NONE, NONE
    graph = traced.program.plans.forward.graph
    sources = [call.sources[p] for p in call.tensor_positions]
    return call_copies(graph, sources, traced.donated, current_backend() == "reference")


def _saved_inputs(program: RegionProgram) -> frozenset[int]:
    """Forward inputs the backward reads (the region holds them until backward())."""
    return frozenset(s.source[1] for s in program.plans.saved if s.source[0] == "input")


def _captured_flags(captured: list) -> tuple[bool, ...]:
    enabled = is_grad_enabled()
    return tuple(bool(t._requires_grad and enabled) for t in captured)


@overload
def compile(  # noqa: A001
    fn: Callable[..., Any],
    *,
    remat: bool = True,
    saved_bytes_budget: int | None = None,
    static_argnums: Sequence[int] = (),
    static_argnames: Sequence[str] = (),
    donate_argnums: Sequence[int] = (),
    cache_size: int = DEFAULT_CACHE_SIZE,
    background: bool | None = None,
    max_peak_bytes: int | None = None,
    saved_dtype=None,
    dynamic=None,
    allow_saved_dtype=None,
) -> CompiledFunction: ...


@overload
def compile(  # noqa: A001
    fn: None = None,
    *,
    remat: bool = True,
    saved_bytes_budget: int | None = None,
    static_argnums: Sequence[int] = (),
    static_argnames: Sequence[str] = (),
    donate_argnums: Sequence[int] = (),
    cache_size: int = DEFAULT_CACHE_SIZE,
    background: bool | None = None,
    max_peak_bytes: int | None = None,
    saved_dtype=None,
    dynamic=None,
    allow_saved_dtype=None,
) -> Callable[[Callable[..., Any]], CompiledFunction]: ...


def compile(  # noqa: A001
    fn: Callable[..., Any] | None = None,
    *,
    remat: bool = True,
    saved_bytes_budget: int | None = None,
    static_argnums: Sequence[int] = (),
    static_argnames: Sequence[str] = (),
    donate_argnums: Sequence[int] = (),
    cache_size: int = DEFAULT_CACHE_SIZE,
    background: bool | None = None,
    max_peak_bytes: int | None = None,
    saved_dtype=None,
    dynamic=None,
    allow_saved_dtype=None,
) -> CompiledFunction | Callable[[Callable[..., Any]], CompiledFunction]:
    """Trace fn on its first call per signature into static forward and backward plans.

    Tensors, NumPy arrays and Python floats are dynamic: a float is traced as a weakly typed
    0-d tensor (it never widens float32), so a new learning rate does not retrace. Ints, bools,
    strings and None are static: part of the signature, so a new value retraces.
    static_argnums / static_argnames make every leaf of those arguments static (a float that
    must be a Python number: a shape, an op attribute, a branch condition).
    NumPy arrays cost what tensors do: the plan reads them in place, through a read-only view,
    and copies one only where a result or a buffer saved for backward would keep it, so
    changing an array after the call never changes what the call returned.

    donate_argnums: arguments whose buffers the call may overwrite with its results (each
    output takes the first donated input of its dtype and shape), so a training step
    `params, state = step(params, state, x, y)` allocates no new parameter memory. The
    donated tensors cannot be used afterwards (bp.DonatedError names the call).

    remat: values that a short chain of cheap ops rebuilds from what backward holds anyway are
    recomputed in backward instead of saved. `bp.compile(remat=False)(fn)` saves everything.
    max_peak_bytes: the most bytes the step (your arrays, forward, saved buffers, backward)
    may hold at once; backplan recomputes what it must (any op, whole segments between the
    values it keeps) with the fewest added FLOPs, or raises bp.MemoryBudgetError before
    compiling, saying the smallest peak reachable and the ways out. `fn.memory_frontier(...)`
    lists the plans to choose from; the planner counts, as explain does, the copy each call
    takes of a NumPy argument its backward reads: under a budget a NumPy array and a tensor
    are different signatures, each planned for what it holds (a switch retraces).
    saved_bytes_budget: the same for the bytes the forward saves for backward (your own
    arrays excluded, those copies counted, as explain's saved bytes count them): met by
    recomputing, or refused.
    saved_dtype=bp.bfloat16 stores the float32 values the forward saves for backward in
    bfloat16 (half the bytes; the backward reads them rounded to 8 significant bits); your own
    arrays and returned outputs that backward reads are held as they are.
    allow_saved_dtype=bp.bfloat16 lets max_peak_bytes or saved_bytes_budget be met that way
    too: the planner keeps full precision when a plan fits, and prefers bfloat16 saved
    buffers (no added FLOPs, a rounding) to recomputing; explain() says which it chose.
    cache_size: signatures kept (least recently used leave first); after 8 retraces a
    bp.RetraceWarning says what changed.

    dynamic={"x": {0: "batch"}}: axis 0 of argument x is a symbol, so every batch size (but 0
    and 1, planned on their own) runs one plan, traced once, with the same kernels and driver;
    `explain()` shows its memory as formulas of the symbol. Where the function's plans differ
    with the size in a way that is not a formula, each size is planned on its own and explain
    says why (tracer/dynamic.py). None (default): an axis becomes dynamic by itself when a
    call differs from an earlier one only in that axis's size (the second size seen on it);
    False: every size is its own signature.

    background=True: a plan's first calls (forward, and backward through .backward()) run on
    the reference interpreter, waiting for no compiler, while a background process compiles
    its kernels and driver; calls switch to them once built (one stderr line says so).
    `fn.driver_tier` says what runs now, `fn.wait_until_compiled()` waits for the switch.
    background=False compiles in the first call; None (default) follows BACKPLAN_DRIVER.

    >>> import backplan as bp
    >>> @bp.compile
    ... def loss(w, x):
    ...     return bp.tanh(x @ w).sum()
    >>> w = bp.tensor([[0.5], [0.25]], requires_grad=True)
    >>> loss(w, bp.tensor([[1.0, 2.0]])).backward()
    >>> w.grad.shape
    (2, 1)
    """
    options = dict(
        remat=remat,
        saved_bytes_budget=saved_bytes_budget,
        static_argnums=static_argnums,
        static_argnames=static_argnames,
        donate_argnums=donate_argnums,
        cache_size=cache_size,
        background=check_background(background),
        max_peak_bytes=max_peak_bytes,
        saved_dtype=saved_dtype,
        dynamic=dynamic,
        allow_saved_dtype=allow_saved_dtype,
    )
    if fn is None:
        return lambda f: CompiledFunction(_callable(f), **options)
    return CompiledFunction(_callable(fn), **options)


def _callable(fn):
    """bp.compile(3) or bp.compile(params) was taken and failed at the first call, far away."""
    if not callable(fn):
        raise TypeError(
            f"bp.compile takes a function, got {type(fn).__name__} {fn!r:.60}; write "
            "bp.compile(fn) or @bp.compile above a def (options as keywords: "
            "bp.compile(fn, donate_argnums=(0,)))"
        )
    return fn
