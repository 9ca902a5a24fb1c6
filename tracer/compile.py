"""@compile: trace a function once per signature into a region program, then run the plans."""

from __future__ import annotations

import functools
import warnings
from collections import OrderedDict
from dataclasses import dataclass

from backplan.ir.pipeline import build_region_plans
from backplan.runtime import RegionProgram, is_grad_enabled
from backplan.runtime.execute import run_forward

from .arguments import ArgumentSpec
from .captured_names import captured_names
from .donate import check_donated_inputs, donatable, mark_donated
from .errors import TracingError
from .fastpath import call_key, positions_of
from .pytree import TreeDef, flatten, unflatten
from .reports import explain_traced
from .signature import SignatureKey, bind_call, input_tensor, miss_reason
from .source import loc_text, user_frame_loc
from .tensor import Tensor
from .trace import Trace, current_trace, tracing


DEFAULT_CACHE_SIZE = 64
RETRACE_WARNING = 8  # retraces of one function before it warns


@dataclass
class CacheInfo:
    traces: int
    hits: int
    misses: int
    last_miss_reason: str | None
    entries: int


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


def trace_function(fn, name: str, call) -> tuple[Trace, list, TreeDef]:
    """Run fn on tracers; returns the trace, output leaves and output structure."""
    trace = Trace(name)
    leaves = list(call.leaves)
    for pos, key in zip(
        call.tensor_positions, [call.key.leaves[p] for p in call.tensor_positions], strict=True
    ):
        value = trace.graph.add_input(_type_of(leaves[pos]))
        leaves[pos] = Tensor._traced(value, trace, key.requires_grad, weak=key.weak)
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
    return run_tensors(traced, tensors, record)


def run_tensors(traced: TracedFunction, tensors: list, record: bool = True):
    tensors = tensors + traced.captured
    wrt = traced.program.plans.wrt
    loc = loc_text(user_frame_loc())
    edges = None
    if record and any(wrt):
        edges = [t._edge() for t, w in zip(tensors, wrt, strict=True) if w]
    donate = donatable(tensors, traced.donated) if traced.donated else ()
    arrays = [t._data for t in tensors]
    outputs, region = run_forward(traced.program, arrays, edges, loc, donate)
    if traced.donated:
        mark_donated(tensors, traced, loc)
    grads = traced.program.differentiable_outputs
    leaves = []
    for kind, item in traced.out_slots:
        if kind == "static":
            leaves.append(item)
        elif region is not None and item in grads:
            leaves.append(Tensor._from_array(outputs[item], grad_fn=region, out_index=item))
        else:
            leaves.append(Tensor._from_array(outputs[item]))
    return unflatten(traced.out_treedef, leaves)


class RetraceWarning(UserWarning):
    """A compiled function keeps retracing: each new signature costs a trace and a compile."""


class CompiledFunction:
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
    ):
        self.fn = fn
        self.remat = remat
        self.saved_bytes_budget = saved_bytes_budget
        functools.update_wrapper(self, fn)
        self.arguments = ArgumentSpec(fn, static_argnums, static_argnames, donate_argnums)
        if cache_size < 1:
            raise ValueError(f"cache_size must be at least 1, got {cache_size}")
        self.cache_size = cache_size
        self._cache: OrderedDict[SignatureKey, TracedFunction] = OrderedDict()
        self._fast: dict = {}  # fastpath.call_key -> (traced, dynamic leaf positions, key)
        self._traces = self._hits = self._misses = 0
        self._last_key: SignatureKey | None = None
        self._last_miss_reason: str | None = None
        self._miss_reasons: list[str] = []
        self._warned = False

    def __call__(self, *args, **kwargs):
        if current_trace() is not None:
            return self.fn(*args, **kwargs)  # nested compiled functions inline
        spec = self.arguments
        key, leaves = call_key(
            args, kwargs, is_grad_enabled(), spec.static_nums, spec.static_names
        )
        hit = self._fast.get(key) if key is not None else None
        if hit is not None:
            traced, positions, signature = hit
            if self._captured_unchanged(traced):
                self._hits += 1
                self._cache.move_to_end(signature)
                return run_tensors(traced, [input_tensor(leaves[i]) for i in positions])
        call = bind_call(self.fn, args, kwargs, spec.static_names)
        traced = self.lookup(call)
        if key is not None:
            positions = positions_of([call.sources[p] for p in call.tensor_positions], leaves)
            if positions is not None:
                self._fast[key] = (traced, positions, call.key)
        return run_traced(traced, call)

    @staticmethod
    def _captured_unchanged(traced) -> bool:
        if not traced.captured:
            return True
        enabled = is_grad_enabled()
        return traced.captured_flags == tuple(
            bool(t._requires_grad and enabled) for t in traced.captured
        )

    def lookup(self, call) -> TracedFunction:
        traced = self._cache.get(call.key)
        if traced is not None:
            flags = tuple(bool(t.requires_grad and is_grad_enabled()) for t in traced.captured)
            if flags == traced.captured_flags:
                self._hits += 1
                self._cache.move_to_end(call.key)
                return traced
        self._misses += 1
        self._last_miss_reason = (
            miss_reason(self._last_key, call.key)
            if traced is None
            else "requires_grad of a captured tensor changed"
        )
        traced = self._trace(call)
        self._remember(call.key, traced)
        self._last_key = call.key
        self._note_retrace(self._last_miss_reason)
        return traced

    def _remember(self, key: SignatureKey, traced: TracedFunction) -> None:
        """Least recently used signatures leave the cache beyond cache_size."""
        self._cache[key] = traced
        self._cache.move_to_end(key)
        while len(self._cache) > self.cache_size:
            _, evicted = self._cache.popitem(last=False)
            self._fast = {k: v for k, v in self._fast.items() if v[0] is not evicted}

    def _note_retrace(self, reason: str) -> None:
        """Warn once, after RETRACE_WARNING retraces, with what changed each time."""
        if self._traces > 1:
            self._miss_reasons.append(reason)
        if self._warned or len(self._miss_reasons) < RETRACE_WARNING:
            return
        self._warned = True
        name = getattr(self.fn, "__qualname__", "the function")
        reasons = "\n".join(f"  - {r}" for r in self._miss_reasons[-RETRACE_WARNING:])
        warnings.warn(
            f"{name} has been traced {self._traces} times; each new signature traces and "
            f"compiles again. What changed:\n{reasons}\nKeep shapes, dtypes and static values "
            "(ints, strings, arguments in static_argnames) the same from call to call; Python "
            "floats are traced and never cause a retrace.",
            RetraceWarning,
            stacklevel=4,
        )

    def _trace(self, call) -> TracedFunction:
        name = getattr(self.fn, "__name__", "compiled")
        trace, out_leaves, out_treedef = trace_function(self.fn, name, call)
        graph = trace.graph
        outputs, out_slots = [], []
        for leaf in out_leaves:
            if isinstance(leaf, Tensor):
                out_slots.append(("tensor", len(outputs)))
                outputs.append(trace.value_of(leaf))
            else:
                out_slots.append(("static", leaf))
        graph.outputs = outputs
        captured_flags = tuple(bool(t.requires_grad and is_grad_enabled()) for t in trace.captured)
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
        plans = build_region_plans(
            graph, wrt, remat=self.remat, saved_bytes_budget=self.saved_bytes_budget
        )
        program = RegionProgram(plans, name=name, input_names=names, donated=donated)
        self._traces += 1
        return TracedFunction(
            program,
            out_treedef,
            out_slots,
            trace.captured,
            captured_flags,
            names,
            donated,
            f"{name}() (bp.compile(donate_argnums={self.arguments.donate_nums}))",
        )

    def trace(self, *args, **kwargs) -> TracedFunction:
        """Trace (or find in the cache) without running: the plans for this signature."""
        if current_trace() is not None:
            raise TracingError("trace() cannot be called inside a traced function")
        return self.lookup(bind_call(self.fn, args, kwargs, self.arguments.static_names))

    def explain(self, *args, **kwargs):
        """The plan for this signature as a report (text, DOT, picture); nothing runs.
        See `backplan.explain`."""
        traced = self.trace(*args, **kwargs)
        return explain_traced(traced, self.cache_info())

    def cache_info(self) -> CacheInfo:
        return CacheInfo(
            self._traces, self._hits, self._misses, self._last_miss_reason, len(self._cache)
        )

    def clear_cache(self) -> None:
        self._cache.clear()
        self._fast.clear()


def compile(  # noqa: A001
    fn=None,
    *,
    remat: bool = True,
    saved_bytes_budget: int | None = None,
    static_argnums=(),
    static_argnames=(),
    donate_argnums=(),
    cache_size: int = DEFAULT_CACHE_SIZE,
):
    """Trace fn on its first call per signature into static forward and backward plans.

    Tensors, NumPy arrays and Python floats are dynamic: a float is traced as a weakly typed
    0-d tensor (it never widens float32), so a new learning rate does not retrace. Ints, bools,
    strings and None are static: part of the signature, so a new value retraces.
    static_argnums / static_argnames make every leaf of those arguments static (a float that
    must be a Python number: a shape, an op attribute, a branch condition).

    donate_argnums: arguments whose buffers the call may overwrite with its results (each
    output takes the first donated input of its dtype and shape), so a training step
    `params, state = step(params, state, x, y)` allocates no new parameter memory. The
    donated tensors cannot be used afterwards (bp.DonatedError names the call).

    remat: values that a short chain of cheap ops rebuilds from what backward holds anyway are
    recomputed in backward instead of saved; saved_bytes_budget stops that once the saved bytes
    (region inputs excluded) fit the budget. `bp.compile(remat=False)(fn)` saves everything.
    cache_size: signatures kept (least recently used leave first); after 8 retraces a
    RetraceWarning says what changed.

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
    )
    if fn is None:
        return lambda f: CompiledFunction(f, **options)
    return CompiledFunction(fn, **options)
