"""value_and_grad and grad: forward and backward traced into one joint plan."""

from __future__ import annotations

import functools
import inspect
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from operator import itemgetter
from typing import Any

import numpy as np

from backplan.ir.errors import DtypeError, MemoryBudgetError
from backplan.ir.gc_pause import paused_gc
from backplan.ir.graph import inline_graph
from backplan.ir.liveness import Plan
from backplan.ir.pipeline import PipelineOptions, plan_choices
from backplan.ir.symbolic import fit_plans
from backplan.ir.types import is_float
from backplan.runtime.backend import current_backend, runner_for

from .budget import BudgetPlanner, checked_budget, inlined_budget_refusal
from .compile import CompiledFunction, checked_saved_dtypes, trace_function
from .compile import compile as compile_function
from .dynamic import sizes_planned_apart, symbolic_key
from .errors import TracingError
from .fastpath import positions_of
from .numpy_args import arrays_reader, kept_by_outputs, reference_copies
from .operand_errors import how_to_pass, what_value_is
from .planned import PlannedFunction, check_background
from .pytree import flatten, unflatten, unflattener
from .reports import explain_joint, inner_joint, named_reason
from .saved_dtype_check import check_saved_dtype_narrows
from .signature import bind_call, closest_key, copied_leaves, miss_reason
from .source import loc_text, user_frame_loc
from .tensor import Tensor
from .trace import current_trace


@dataclass
class JointTrace:
    """One signature of value_and_grad: the joint plan (outputs: loss, aux leaves, gradients in
    input order) and the tensors the function captured (extra inputs after the call's)."""

    plan: Plan
    captured: list
    aux_treedef: object
    n_aux: int
    wrt: list[bool]
    background: bool | None = None  # value_and_grad(background=...)
    _runners: dict = field(default_factory=dict)
    planner: BudgetPlanner | None = None  # the plans this signature could run instead

    def runner(self):
        """The runner for the backend current now (use_backend switches between calls)."""
        return runner_for(self.plan, self._runners, self.background)

    def runners(self) -> list:
        return list(self._runners.values())


def _argnums_tuple(argnums) -> tuple[int, ...]:
    return (argnums,) if isinstance(argnums, int) else tuple(argnums)


@dataclass
class JointCall:
    """A bound call of value_and_grad: the arguments (differentiated ones as tensors), the
    signature binding, and the leaf positions that are differentiated."""

    args: tuple
    call: object
    diff_paths: set

    @property
    def key(self):
        return (self.call.key, frozenset(self.diff_paths))


class ValueAndGradFunction(PlannedFunction):
    """See `value_and_grad`."""

    not_returned: frozenset = frozenset()  # outputs of the joint plan a call does not return

    def __init__(
        self,
        fn,
        argnums=0,
        has_aux: bool = False,
        background: bool | None = None,
        max_peak_bytes: int | None = None,
        saved_dtype=None,
        allow_saved_dtype=None,
    ):
        if background is None and isinstance(fn, PlannedFunction):
            background = fn.background  # bp.compile(fn, background=...) inlines into this plan
        super().__init__(fn, background=background)
        self.max_peak_bytes = checked_budget(max_peak_bytes, "max_peak_bytes")
        self.saved_dtype, self.allow_saved_dtype = checked_saved_dtypes(
            saved_dtype, allow_saved_dtype
        )
        self._traced_fn = self._take_compiled_options(fn)
        max_peak_bytes = self.max_peak_bytes
        functools.update_wrapper(self, fn, updated=())  # not fn.__dict__: ours
        self.argnums = argnums
        self.has_aux = has_aux
        self._nums = _argnums_tuple(argnums)
        self._single = isinstance(argnums, int)
        self._dynamic = dict(getattr(fn, "_dynamic", None) or {})  # bp.compile(dynamic=...)
        self._auto_dynamic = getattr(fn, "_auto_dynamic", True) and max_peak_bytes is None
        if getattr(fn, "_auto_dynamic", True) and max_peak_bytes is not None:
            self._sizes_apart = sizes_planned_apart("max_peak_bytes")
        self._parameters = _parameter_names(fn) if self._dynamic else None

    def _take_compiled_options(self, fn):
        """value_and_grad(bp.compile(f, max_peak_bytes=N)): value_and_grad traces f into its
        joint plan, so the compiled function's budget and saved dtypes are this plan's (where
        value_and_grad gives none): the function to trace, f itself when they were taken.
        A saved_bytes_budget there is refused: a joint plan has no saved buffers for it to
        count (never silently ignored)."""
        if not isinstance(fn, CompiledFunction):
            return fn
        name = getattr(fn, "__name__", "fn")
        if fn.saved_bytes_budget is not None:
            raise ValueError(
                f"value_and_grad(bp.compile({name}, saved_bytes_budget="
                f"{fn.saved_bytes_budget:,})): value_and_grad plans the forward and the "
                "gradients as one joint plan, which keeps no saved buffers for that budget to "
                "count; give max_peak_bytes=N (the step's peak) to value_and_grad or to bp.compile"
            )
        taken = (fn.max_peak_bytes, fn.saved_dtype, fn.allow_saved_dtype)
        if not any(option is not None for option in taken):
            return fn
        if self.max_peak_bytes is None:
            self.max_peak_bytes = fn.max_peak_bytes
        if self.saved_dtype is None and self.allow_saved_dtype is None:
            self.saved_dtype, self.allow_saved_dtype = fn.saved_dtype, fn.allow_saved_dtype
        return fn.fn

    def with_budget(self, max_peak_bytes: int):
        """The same function planned with another max_peak_bytes (bp.max_batch asks)."""
        return type(self)(
            self.fn,
            self.argnums,
            self.has_aux,
            self.background,
            max_peak_bytes,
            self.saved_dtype,
            self.allow_saved_dtype,
        )

    def _call_in_trace(self, args, kwargs):
        """Inlined into the traced function's plan, which is planned as a whole: a budget of
        this one's would silently not hold there, so it is refused."""
        if self.max_peak_bytes is not None:
            raise MemoryBudgetError(inlined_budget_refusal(self.fn, self.max_peak_bytes))
        return super()._call_in_trace(args, kwargs)

    def batch_leaf(self, position: int, leaf) -> bool:
        """Whether a leaf of argument `position` is data with a batch axis: the arguments
        that are not differentiated (bp.max_batch resizes those by default)."""
        return position not in self._nums

    def _bind(self, args, kwargs) -> JointCall:
        args = tuple(_as_diff_arg(a) if i in self._nums else a for i, a in enumerate(args))
        for i in self._nums:
            if i >= len(args):
                raise TypeError(
                    f"argnums={self.argnums} differentiates argument {i} of {_defined(self.fn)}"
                    f", but the call at {loc_text(user_frame_loc())} passes {len(args)} "
                    "positional argument(s); argnums counts positional arguments from 0 "
                    "(pass the differentiated ones by position)"
                )
        _refuse_foreign_differentiated(args, self._nums)  # before binding refuses it as data
        try:
            call = bind_call(_positional(self.fn), args, kwargs)
        except DtypeError as exc:  # "args[1]" as the user's function names it: "x"
            raise DtypeError(named_reason(self.fn, str(exc))) from None
        return JointCall(args, call, _diff_positions(call, args, self._nums))

    def _miss_reason(self, key, stale) -> str | None:
        return named_reason(self.fn, self._positional_miss_reason(key))

    def _entry_key(self, bound: JointCall):
        found = self._symbol_of(bound)
        key = bound.call.key if found is None else symbolic_key(bound.call.key, found)
        return (key, frozenset(bound.diff_paths))

    def _signature_of_key(self, key):
        return key[0]

    def _display(self, text: str) -> str:
        return named_reason(self.fn, text)

    def _signature_call(self, bound: JointCall):
        return bound.call

    def _with_call(self, bound: JointCall, call):
        return replace(bound, call=call)

    def _argument_of(self, call, position: int) -> str:
        """The inner function's parameter name of a leaf ("args[1]..." is its second)."""
        match = re.match(r"args\[(\d+)\]", call.key.leaves[position].path)
        names = self._parameters or []
        if match and int(match.group(1)) < len(names):
            return names[int(match.group(1))]
        return call.arguments[position]

    def _fit(self, entries: list[JointTrace], sizes: list[int]):
        return fit_plans([e.plan for e in entries], sizes)

    def _instantiate(self, template: JointTrace, fitted, size: int) -> JointTrace:
        """The signature's joint plan at another size: instantiated, no trace."""
        return replace(template, plan=fitted.at(size)[0], _runners={}, planner=None)

    def _positional_miss_reason(self, key) -> str:
        if self._last_key is None:
            return miss_reason(None, key[0])
        new, new_diff = key
        cached = tuple(self._entries)  # one step under the GIL: other threads may move keys
        same_diff = [k for k, diff in cached if diff == new_diff]
        old = closest_key(same_diff, new, None)
        if old is None:
            old, old_diff = self._last_key
            if old_diff != new_diff and old.treedef == new.treedef:
                return "the differentiated arguments changed"
        return miss_reason(old, new)

    def _build(self, bound: JointCall) -> JointTrace:
        entry = _trace_joint(
            self._traced_fn,
            bound.call,
            bound.diff_paths,
            self.has_aux,
            self.max_peak_bytes,
            (self.saved_dtype, self.allow_saved_dtype),
            self.not_returned,
        )
        entry.background = self.background
        return entry

    def _run(self, entry: JointTrace, bound: JointCall):
        outer = current_trace()
        if outer is not None:  # inlined: the outer plan's explain() lists what this one saves
            outer.inner_joints.append(inner_joint(entry, bound.call, self.fn))
        return run_joint(
            entry, bound.args, bound.call, bound.diff_paths, self._nums, self.has_aux, self._single
        )

    def _fast_runner(self, entry: JointTrace, bound: JointCall, leaves: list):
        return _fast_joint(
            entry,
            bound.args,
            bound.call,
            bound.diff_paths,
            self._nums,
            self.has_aux,
            self._single,
            leaves,
        )

    def _report(self, entry: JointTrace, bound: JointCall):
        return explain_joint(entry, bound.call, self.fn, self.cache_info())


def value_and_grad(
    fn: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    background: bool | None = None,
    max_peak_bytes: int | None = None,
    saved_dtype=None,
    allow_saved_dtype=None,
    **compile_only: Any,
) -> ValueAndGradFunction:
    """Return a function computing (fn(*args), gradients of fn w.r.t. args[argnums]).
    Gradients have the structure of those arguments. With has_aux, fn returns (loss, aux) and
    the result is ((loss, aux), grads). Works inside traces, so grad(grad(f)) works.
    background: as in bp.compile, for the joint plan (None takes fn's own when fn is a
    bp.compile function, whose trace this plan inlines; else BACKPLAN_DRIVER's).
    max_peak_bytes: as in bp.compile, for the joint plan: the step's peak fits it, at the
    fewest added FLOPs, or bp.MemoryBudgetError says why not before anything compiles.
    saved_dtype=bp.bfloat16: as in bp.compile, the forward values the gradient part reads are
    kept in bfloat16 between the two parts (your arrays and returned outputs as they are).
    allow_saved_dtype: as in bp.compile, max_peak_bytes may be met that way too.

    >>> import backplan as bp
    >>> f = bp.value_and_grad(lambda x: (x ** 3).sum())
    >>> value, g = f(bp.tensor([2.0]))
    >>> g.numpy().tolist()
    [12.0]
    """
    _refuse_compile_options("value_and_grad", compile_only)
    return ValueAndGradFunction(
        fn,
        argnums,
        has_aux,
        check_background(background),
        max_peak_bytes,
        saved_dtype,
        allow_saved_dtype,
    )


def run_joint(entry: JointTrace, args, call, diff_paths, nums, has_aux: bool, single: bool):
    """Run (or inline into the active trace) a joint plan; returns (value, grads) with grads
    shaped like the differentiated arguments. Loaded artifacts run through here too."""
    tensors = [call.leaves[p] for p in call.tensor_positions] + entry.captured
    outer = current_trace()
    if outer is not None:
        values = inline_graph(outer.graph, entry.plan.graph, [outer.value_of(t) for t in tensors])
        outer.inlined_losses.extend(values[: 1 + entry.n_aux])
        outer.inlined_gradients.extend(values[1 + entry.n_aux :])
        results = [Tensor._traced(v, outer) for v in values]
    else:
        arrays = [t._data for t in tensors]
        if getattr(call, "borrowed", None):  # views of the caller's arrays (bind_call)
            arrays = _owned_where_kept(entry, call, arrays)
        # the plan's own buffers (an output reading a caller's array got a copy above), as
        # _fast_joint's later calls wrap them: a first call copied each view (attention's
        # gradients, views of one output), so it held more than explain's peak counts
        results = list(map(Tensor._fresh, entry.runner()(arrays)))
    n_aux = entry.n_aux
    value, aux, grads = results[0], results[1 : 1 + n_aux], results[1 + n_aux :]
    grads = _grads_like(args, nums, diff_paths, grads, single=single)
    if has_aux:
        return (value, unflatten(entry.aux_treedef, aux)), grads
    return value, grads


def _owned_where_kept(entry: JointTrace, call, arrays: list) -> list:
    """The first call's arrays with each NumPy argument bind_call wrapped as a view copied
    where the fast path's reader copies it (joint_reader): the same buffers as later calls."""
    positions = call.tensor_positions
    sources = [call.sources[p] for p in positions]
    read = joint_reader(entry, sources)
    owned = read(sources, current_backend() == "reference")
    return [
        owned[k] if p in call.borrowed else array
        for k, (p, array) in enumerate(zip(positions, arrays, strict=False))
    ] + arrays[len(positions) :]


def joint_reader(entry: JointTrace, leaves: list):
    """arrays_reader for a joint plan's inputs passed as `leaves` (in the plan's order): a
    NumPy array copied only where an output reads it (and, on the reference interpreter, where
    it is not in C order), else borrowed."""
    graph = entry.plan.graph
    kept = kept_by_outputs(graph)
    interpreted = reference_copies(graph, kept_by_outputs(graph, reference=True), leaves)
    return arrays_reader(
        [type(leaf) for leaf in leaves], [k in kept for k in range(len(leaves))], interpreted
    )


def _fast_joint(entry, args, call, diff_paths, nums, has_aux, single, leaves):
    """A call for later calls with the same key: arrays in, tensors out, no binding; how the
    leaves are read and how the outputs are shaped is worked out here, once."""
    positions = positions_of([call.sources[p] for p in call.tensor_positions], leaves)
    if positions is None:
        return None
    read = joint_reader(entry, [leaves[i] for i in positions])
    pick = None if positions == list(range(len(leaves))) else itemgetter(*positions)
    captured, runners = entry.captured, entry._runners
    build_results = _results_builder(entry, args, nums, has_aux, single)

    def call_fast(leaves):
        backend = current_backend()
        runner = runners.get(backend) or entry.runner()
        picked = leaves if pick is None else _as_list(pick(leaves))
        arrays = read(picked, backend == "reference")
        if captured:
            arrays += [t._data for t in captured]
        return build_results(list(map(Tensor._fresh, runner(arrays))))

    return call_fast


def _as_list(picked) -> list:
    return list(picked) if type(picked) is tuple else [picked]


def _results_builder(entry, args, nums, has_aux: bool, single: bool):
    """tensors (the joint plan's outputs) -> (value, grads) or ((value, aux), grads)."""
    grad_builders, start = [], 1 + entry.n_aux
    for i in nums:
        structure = flatten(args[i])[1]
        grad_builders.append((unflattener(structure), start, start + structure.num_leaves))
        start += structure.num_leaves
    if single and not has_aux:
        ((build_grads, first, end),) = grad_builders
        return lambda tensors: (tensors[0], build_grads(tensors[first:end]))
    aux_builder = unflattener(entry.aux_treedef) if has_aux else None
    n_aux = entry.n_aux

    def build(tensors: list):
        each = [build_grads(tensors[a:b]) for build_grads, a, b in grad_builders]
        grads = each[0] if single else tuple(each)
        if aux_builder is not None:
            return (tensors[0], aux_builder(tensors[1 : 1 + n_aux])), grads
        return tensors[0], grads

    return build


class GradFunction(ValueAndGradFunction):
    """See `grad`: the same plans, returning only the gradients."""

    not_returned = frozenset({0})  # the value: a loop keeps no old one (loop peak)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        value_aux, grads = super().__call__(*args, **kwargs)
        return (grads, value_aux[1]) if self.has_aux else grads

    def _report(self, entry: JointTrace, bound: JointCall):
        report = super()._report(entry, bound)
        report.not_returned = self.not_returned
        return report


def grad(
    fn: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    background: bool | None = None,
    max_peak_bytes: int | None = None,
    saved_dtype=None,
    allow_saved_dtype=None,
    **compile_only: Any,
) -> GradFunction:
    """Like value_and_grad, returning only the gradients (and aux with has_aux)."""
    _refuse_compile_options("grad", compile_only)
    return GradFunction(
        fn,
        argnums,
        has_aux,
        check_background(background),
        max_peak_bytes,
        saved_dtype,
        allow_saved_dtype,
    )


def _refuse_compile_options(api: str, options: dict) -> None:
    """dynamic=, static_argnums=, donate_argnums=, remat= ... belong to the function being
    differentiated: Python's own "unexpected keyword argument 'dynamic'" did not say where."""
    if not options:
        return
    known = set(inspect.signature(compile_function).parameters) - {"fn"}
    theirs = sorted(name for name in options if name in known)
    if not theirs:
        raise TypeError(f"bp.{api}() got an unexpected keyword argument {sorted(options)[0]!r}")
    given = ", ".join(f"{name}=..." for name in theirs)
    what = "it is a bp.compile option" if len(theirs) == 1 else "they are bp.compile options"
    raise TypeError(
        f"bp.{api}() takes no {', '.join(theirs)}: {what} of the function it differentiates: "
        f"bp.{api}(bp.compile(loss, {given}))"
    )


def _parameter_names(fn) -> list[str]:
    """The parameter names of the function a value_and_grad differentiates (through a
    bp.compile wrapper: its fn)."""
    try:
        return list(inspect.signature(getattr(fn, "fn", fn)).parameters)
    except (TypeError, ValueError):
        return []


def _positional(fn):
    """A stand-in signature (*args, **kwargs) so argnums counts positions, as in JAX; named as
    fn, so what names the function names the user's."""

    def call_through(*args, **kwargs):
        return fn(*args, **kwargs)

    call_through.__name__ = getattr(fn, "__name__", call_through.__name__)
    call_through.__qualname__ = getattr(fn, "__qualname__", call_through.__name__)
    return call_through


def _as_diff_arg(arg):
    """A float argument to differentiate becomes a weakly typed 0-d tensor, as when it is not
    differentiated (x_f32 * scale stays float32, as in JAX). NumPy arrays stay as they are:
    binding makes them tensors, and the fast path finds them among the call's leaves."""
    if type(arg) is float:
        return Tensor._weak_scalar(arg)
    return arg


def _kind_text(leaf) -> str:
    """'an int', 'a str', 'an int64 tensor', 'a NumPy scalar (numpy.float64)': what a leaf
    that cannot be differentiated is."""
    if isinstance(leaf, np.generic):
        return f"a NumPy scalar (numpy.{type(leaf).__name__})"
    if not isinstance(leaf, Tensor) and type(leaf).__module__ != "builtins":
        return what_value_is(leaf)  # 'a torch.Tensor of shape ...', not 'a Tensor'
    what = f"{leaf.dtype} tensor" if isinstance(leaf, Tensor) else type(leaf).__name__
    return f"{'an' if what[0] in 'aeiou' else 'a'} {what}"


def _not_differentiable(i: int, leaf, path: str) -> TypeError:
    fix = (
        "pass it as another argument, or mark a dataclass field that is not a tensor with "
        "bp.tree.static_field()"
    )
    tensors = "float tensors"
    if hasattr(leaf, "__dlpack__") and not isinstance(leaf, Tensor | np.ndarray):
        fix, tensors = how_to_pass(leaf), "backplan's float tensors"  # a float torch tensor too
    if isinstance(leaf, np.generic) and np.issubdtype(leaf.dtype, np.floating):
        fix = (
            "pass a Python float (float(x)), a 0-d array (np.asarray(x)) or a tensor "
            "(bp.tensor(x)) to differentiate it"
        )
    kind = _kind_text(leaf)
    what = f"is {kind}" if path == "<leaf>" else f"holds {kind} leaf at {path}"  # the argument
    return TypeError(
        f"argument {i} of a differentiated function {what} (the call at "
        f"{loc_text(user_frame_loc())}); only {tensors} can be differentiated ({fix})"
    )


def _diff_positions(call, args, nums) -> set[int]:
    """Leaf positions (in the bound call) that belong to differentiated arguments."""
    positions, start = set(), 0
    for i, arg in enumerate(args):
        count = flatten(arg)[1].num_leaves
        if i in nums:
            for p in range(start, start + count):
                leaf = call.leaves[p]
                if not isinstance(leaf, Tensor) or not is_float(leaf._ir_dtype):
                    paths = flatten(arg, paths=True)[2]  # only to word the error
                    raise _not_differentiable(i, leaf, paths[p - start])
                positions.add(p)
        start += count
    return positions


def _refuse_foreign_differentiated(args, nums) -> None:
    """A differentiated argument holding another framework's array (a torch tensor) is refused
    as not differentiable, which says more than binding's refusal of it as an input."""
    for i in nums:
        if i < len(args):
            leaves, _, paths = flatten(args[i], paths=True)
            for leaf, path in zip(leaves, paths, strict=True):
                if hasattr(leaf, "__dlpack__") and not isinstance(leaf, Tensor | np.ndarray):
                    raise _not_differentiable(i, leaf, path)


def _defined(fn) -> str:
    """'loss_fn (train.py:12)': the differentiated function and where it is defined."""
    inner = inspect.unwrap(fn)
    code = getattr(inner, "__code__", None)
    name = getattr(inner, "__qualname__", getattr(inner, "__name__", "fn"))
    if code is None:
        return name
    return f"{name} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"


def _returned(value) -> str:
    """What a differentiated function returned, in words: 'a tensor f32[2, 4]', 'None'."""
    if isinstance(value, Tensor):
        return f"a tensor {value._ir_dtype}{list(value.shape)}"
    if isinstance(value, tuple | list):
        return f"a {type(value).__name__} of {len(value)}"
    return "None" if value is None else f"a {type(value).__name__}"


def _trace_joint(
    fn, call, diff_paths, has_aux, max_peak_bytes=None, dtypes=(None, None), not_returned=()
):
    """dtypes: (saved_dtype, allow_saved_dtype); not_returned: the outputs the function
    drops (bp.grad's value), which a loop does not keep (the budget counts what it keeps)."""
    name = getattr(fn, "__name__", "fn")
    trace, out_leaves, out_treedef = trace_function(_positional(fn), name, call)
    if has_aux:
        result = unflatten(out_treedef, out_leaves)
        if not isinstance(result, tuple) or len(result) != 2:
            raise TracingError(
                f"has_aux=True needs {_defined(fn)} to return (loss, aux), it returned "
                f"{_returned(result)}"
            )
        loss, aux = result
        aux_leaves, aux_treedef = flatten(aux)
    else:
        if len(out_leaves) != 1:
            raise TracingError(
                f"the differentiated function {_defined(fn)} must return one scalar tensor, it "
                f"returned {_returned(unflatten(out_treedef, out_leaves))} (has_aux=True "
                "returns (loss, aux))"
            )
        loss, aux_leaves, aux_treedef = out_leaves[0], [], None
    if not isinstance(loss, Tensor) or loss.shape != ():
        raise TracingError(
            f"grad needs a scalar loss, {_defined(fn)} returned {_returned(loss)}; reduce it "
            "with .sum() or .mean()"
        )
    if any(not isinstance(a, Tensor) for a in aux_leaves):
        raise TracingError("aux outputs must be tensors")
    graph = trace.graph
    graph.outputs = [trace.value_of(loss)] + [trace.value_of(a) for a in aux_leaves]
    wrt = [p in diff_paths for p in call.tensor_positions] + [False] * len(trace.captured)
    saved_dtype, allow_dtype = dtypes
    with paused_gc():  # ir/gc_pause.py: the pipeline's objects, no garbage to look for
        options = PipelineOptions(joint=True, saved_dtype=saved_dtype, copied=copied_leaves(call))
        choices = plan_choices(graph, wrt, options)
        check_saved_dtype_narrows(choices, dtypes, _defined(fn))
        planner = BudgetPlanner(
            choices,
            sum(v.type.nbytes for v in graph.inputs),
            name,
            allow_dtype=allow_dtype,
        )
        planner.not_kept = frozenset(not_returned)
        plans = planner.build() if max_peak_bytes is None else planner.fit_peak(max_peak_bytes)
    return JointTrace(
        plans.plan, trace.captured, aux_treedef, len(aux_leaves), wrt, planner=planner
    )


def _grads_like(args, nums, diff_paths, grads, single: bool):
    by_position = dict(zip(sorted(diff_paths), grads, strict=True))
    results, start = [], 0
    for i, arg in enumerate(args):
        leaves, treedef = flatten(arg)
        if i in nums:
            results.append(unflatten(treedef, [by_position[start + k] for k in range(len(leaves))]))
        start += len(leaves)
    return results[0] if single else tuple(results)
