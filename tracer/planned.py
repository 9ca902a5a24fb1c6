"""What every planned function shares: `bp.compile`, `bp.value_and_grad` / `bp.grad` and the
functions `bp.load` returns keep traced plans per signature, count hits and misses, say why
the last miss happened, skip argument binding on repeat calls, and answer trace() and
explain(). Subclasses say only how a call is bound, how an entry is built, run and reported."""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from backplan.report.compiled import one_listing
from backplan.runtime import is_grad_enabled
from backplan.runtime.backend import withdraw_arena_offers
from backplan.runtime.tiers import slowest_tier, wait_until_compiled

from .dynamic import (
    DynamicEntry,
    dynamic_text,
    find_symbol,
    fit_entry,
    learn_axis,
    symbolic_key,
    takes_symbol,
)
from .errors import TracingError
from .fastpath import call_key, guard_for
from .frozen_reads import FrozenReads, frozen_reads
from .loop_watch import LoopWatch, sizes
from .signature_switch import release_idle_arenas, release_other_signatures
from .trace import current_trace

STALE = object()  # a fast-path runner's answer when its entry no longer fits the call
DEFAULT_CACHE_SIZE = 64
RETRACE_WARNING = 8  # retraces of one function before it warns
FAST_PATHS_KEPT = 256  # fast paths kept (each call structure and size), then started afresh


class RetraceWarning(UserWarning):
    """A planned function keeps retracing: each new signature costs a trace and a compile."""


@dataclass
class CacheInfo:
    traces: int
    hits: int
    misses: int
    last_miss_reason: str | None
    entries: int


class _Tracing(threading.Event):
    """Set when the thread tracing one signature (owner) is done, entry cached or not."""

    def __init__(self):
        super().__init__()
        self.owner = threading.get_ident()


def _switching(runner, switch):
    """A fast-path runner of one size of a dynamic axis: tells the entry its size first."""

    def run(leaves):
        return _switched(switch, runner, leaves)

    return run


def _switched(switch, run, *args):
    """run(*args) after switch() told a dynamic axis's entry the call's size; the arenas the
    switch freed and offered to this size's arena (codegen/run/arena_memory.py) are withdrawn
    when the call did not take them, so that no call holds another size's memory."""
    if not switch():
        return run(*args)
    try:
        return run(*args)
    finally:
        withdraw_arena_offers()


class FastEntry:
    """One structural key's fast path: its guard, its runner and the cache entry it runs."""

    __slots__ = ("guard", "runner", "entry_key")

    def __init__(self, guard, runner, entry_key):
        self.guard = guard  # fastpath.guard_for(key): (args, kwargs, grad_enabled) -> leaves
        self.runner = runner  # runner(leaves) -> result, or STALE
        self.entry_key = entry_key


def check_background(background) -> bool | None:
    """background= is True, False or None; anything else (a string, 1) is refused by name."""
    if background is None or isinstance(background, bool):
        return background
    raise TypeError(
        f"background must be True, False or None, got {background!r} "
        f"({type(background).__name__}); True runs first calls on the reference interpreter "
        "while the plans compile in a background process, False compiles in the first call"
    )


class PlannedFunction:
    """A function run through plans traced once per signature (see the module docstring).
    background: True runs a plan's first calls on the reference interpreter while a child
    process compiles it, False compiles in its first call, None follows BACKPLAN_DRIVER."""

    def __init__(self, fn, cache_size: int = DEFAULT_CACHE_SIZE, background: bool | None = None):
        if cache_size < 1:
            raise ValueError(f"cache_size must be at least 1, got {cache_size}")
        self.background = check_background(background)
        self.fn = fn
        self.cache_size = cache_size
        self._entries: OrderedDict = OrderedDict()  # entry key -> entry, least recent first
        self._fast: dict = {}  # fastpath.call_key -> FastEntry
        self._last_fast: FastEntry | None = None  # tried first: its guard, no key, no hashing
        self._traces = self._hits = self._misses = 0
        self._last_key = None
        self._most_recent = None  # the fast path's entry key last moved to the end, or None
        self._running = None  # the entry key of the last call: a call of another frees its arenas
        self._last_miss_reason: str | None = None
        self._miss_reasons: list[str] = []  # of every retrace, for the warning
        self._warned = False
        self._static_nums: frozenset = frozenset()  # positions whose floats stay static
        self._static_names: frozenset = frozenset()  # parameter names likewise
        self._lookup_lock = threading.Lock()  # held for cache reads and writes, never a trace
        self._pending: dict = {}  # entry key -> _Tracing, while a thread traces that signature
        self._dynamic: dict = {}  # argument name -> {axis: symbol} (tracer/dynamic.py)
        self._auto_dynamic = False  # learn a dynamic axis from the second size seen on it
        self._learned: dict = {}  # leaf path -> (rank, axis, symbol), learned automatically
        self._sizes_apart: str | None = None  # why no axis becomes dynamic (a memory budget)
        self._reads: FrozenReads | None = None  # of the last trace; None: none to watch
        self._reread: str | None = None  # a rebound variable, the next trace's miss reason
        self._forgotten = 0  # caches dropped for a rebound variable: a trace begun before
        # a drop froze the old object, so its entry is not kept (lookup, __call__)
        self._loop_watch = LoopWatch()  # what a loop does with the results (loop_watch.py)

    # ---- what subclasses provide -------------------------------------------------------------

    def _bind(self, args: tuple, kwargs: dict):
        """The bound call: whatever _build, _run and _report need."""
        raise NotImplementedError

    def _entry_key(self, bound):
        found = self._symbol_of(bound)
        return bound.key if found is None else symbolic_key(bound.key, found)

    def _signature_call(self, bound):
        """The BoundCall inside a bound call (value_and_grad wraps one)."""
        return bound

    def _with_call(self, bound, call):
        """The bound call with its BoundCall replaced (a probe at another size)."""
        return call

    def _fit(self, entries: list, sizes: list[int]):
        """The entries of one signature at three sizes fitted into formulas of the symbol
        (raises ir.symbolic.SymbolicError)."""
        raise NotImplementedError

    def _instantiate(self, template, fitted, size: int):
        """The entry at `size` from the fitted plans: no trace."""
        raise NotImplementedError

    def _symbol_of(self, bound):
        if not self._dynamic and not self._learned:
            return None
        call = self._signature_call(bound)
        return find_symbol(call, self._dynamic, self._argument_of, self._learned)

    def _learn_dynamic(self, bound, key) -> tuple:
        """On a miss, with automatic dynamic axes on and no symbol yet: if the call differs
        from a cached signature only in one axis's size, that axis is dynamic from now on
        (tracer/dynamic.learn_axis). Returns the key to look up and the miss's reason when
        it made an axis dynamic (else None)."""
        if self._dynamic or self._learned or key in self._entries:
            return key, None
        if not self._auto_dynamic and self._sizes_apart is None:
            return key, None
        call = self._signature_call(bound)
        with self._lookup_lock:
            stored_keys = tuple(self._entries)
        cached = [self._signature_of_key(k) for k in stored_keys]
        learned = learn_axis(call.key, [k for k in cached if k is not None])
        if learned is None:
            return key, None
        reason = self._miss_reason(key, None)
        if not self._auto_dynamic:  # a budget: say why this size gets a plan of its own
            return key, f"{reason}; {self._sizes_apart}"
        learned = {p: (r, a, self._display(s)) for p, (r, a, s) in learned.items()}
        self._learned = learned
        self._forget_sized_plans(learned)
        # one symbol; the leaves it sizes may differ in rank (a batch x[n, 8] and labels[n])
        symbol = next(iter(learned.values()))[2]
        axes = sorted({axis for _, axis, _ in learned.values()})
        paths = self._display(", ".join(learned))
        where = f"axis {axes[0]}" if len(axes) == 1 else f"axes {', '.join(map(str, axes))}"
        reason = f"{reason}; {where} of {paths} is dynamic from now on ({symbol}): one plan"
        return self._entry_key(bound), reason + " for every size"

    def _forget_sized_plans(self, learned: dict) -> None:
        """Once an axis is dynamic every size on it runs the symbolic plan: the plans traced
        for one size there (the first size's) and the fast paths running them go, so a call at
        the first size runs what lookup() gives (explain, data_parallel), as torch.compile's
        dynamic graph takes over from its first static one."""
        dropped = []
        with self._lookup_lock:
            for key in tuple(self._entries):
                signature = self._signature_of_key(key)
                if signature is not None and takes_symbol(signature, learned):
                    dropped.append(self._entries.pop(key))
            self._fast = {}
            self._last_fast = None
            self._most_recent = None
        for entry in dropped:  # their arenas go now, not when the last reference does (a
            release_idle_arenas(entry)  # background driver build holds its plan's runner)

    def _display(self, text: str) -> str:
        """Leaf paths as the user names them (value_and_grad binds by position)."""
        return text

    def _signature_of_key(self, key):
        """The SignatureKey inside an entry key (value_and_grad's adds its differentiated
        leaves: only entries differentiating the same leaves compare)."""
        return key

    _argument_of = None  # (call, leaf position) -> parameter name; None: call.arguments

    def _build(self, bound):
        """Trace the function for this call into an entry."""
        raise NotImplementedError

    def _run(self, entry, bound):
        raise NotImplementedError

    def _report(self, entry, bound):
        raise NotImplementedError

    def _still_valid(self, entry) -> bool:
        return True

    def _miss_reason(self, key, stale_entry) -> str | None:
        return None

    def _fast_runner(self, entry, bound, leaves: list):
        """A runner for later calls with the same structural key, or None."""
        return None

    # ---- shared behaviour --------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if current_trace() is not None:
            return self._call_in_trace(args, kwargs)
        reads = self._reads  # None unless the function reads a global or closure number
        if reads is not None and reads.changed():
            self._forget_frozen_reads(stacklevel=2)
        grad_enabled = is_grad_enabled()
        watch = self._loop_watch
        seen = watch.before(args, kwargs) if watch.active else None
        last = self._last_fast
        if last is not None:
            leaves = last.guard(args, kwargs, grad_enabled)
            if leaves is not None:
                result = last.runner(leaves)
                if result is not STALE:
                    self._count_fast_hit(last.entry_key)
                    if watch.active:
                        watch.after(last.entry_key, seen, result, args, kwargs)
                    return result
        # Not the last signature: find its fast path by key, else bind (tracing on a miss).
        # In this frame, so a RetraceWarning points at the caller's line.
        key, leaves = call_key(
            args, kwargs, grad_enabled, self._static_nums, self._static_names, False
        )
        try:
            fast = self._fast.get(key) if key is not None else None
        except TypeError:  # an unhashable static value: the full path says which
            fast = key = None
        if fast is not None:
            if fast.entry_key is not self._running:
                self._switch_signature(fast.entry_key)
            result = fast.runner(leaves)
            if result is not STALE:
                self._count_fast_hit(fast.entry_key)
                self._last_fast = fast
                if watch.active:
                    watch.after(fast.entry_key, seen, result, args, kwargs)
                return result
        forgotten = self._forgotten
        bound, entry = self.lookup(args, kwargs)
        self._switch_signature(self._entry_key(bound))
        self._last_fast = None  # it ran another signature, or is set again below
        switch = self._size_switch(bound)
        if switch is None:
            result = self._run(entry, bound)
        else:
            result = _switched(switch, self._run, entry, bound)
        if key is not None and forgotten == self._forgotten:
            runner = self._fast_runner(entry, bound, leaves)
            if runner is not None:
                runner = runner if switch is None else _switching(runner, switch)
                entry_key = self._shared_entry_key(self._entry_key(bound))
                fast = FastEntry(guard_for(key), runner, entry_key)
                # another thread's call may have evicted the entry meanwhile: a fast path to
                # it would keep its plans and arenas, beyond cache_size, until cleared
                with self._lookup_lock:
                    if entry_key in self._entries:
                        if len(self._fast) >= FAST_PATHS_KEPT:  # a dynamic axis: one per size
                            self._fast = {}  # its runners hold their sizes' plans and arenas
                        self._fast[key] = self._last_fast = fast
        if watch.active:
            watch.after(self._shared_entry_key(self._entry_key(bound)), seen, result, args, kwargs)
        return result

    def _forget_frozen_reads(self, stacklevel: int) -> None:
        """A global or closure variable the traces read holds another object now: every plan
        froze the old one, so the cache is dropped and the next call traces again."""
        with self._lookup_lock:
            reads = self._reads
            if reads is None:  # another thread got here first
                return
            changed = reads.which()
            if changed is None:  # a number rebound to an equal one: nothing to trace again
                reads.refresh()
                return
            self._reads = None
            self._forgotten += 1
        self.clear_cache()
        name = getattr(self.fn, "__qualname__", "the function")
        self._reread = f"{changed} was rebound to another value since the last trace"
        warnings.warn(
            f"{name} reads {changed}, which was rebound after {name} was traced; the plans "
            "froze its old value, so it is traced again. Pass what changes as an argument "
            "(a float argument is traced: a new value costs no retrace).",
            RetraceWarning,
            stacklevel=stacklevel + 1,
        )

    def _switch_signature(self, entry_key) -> None:
        """A call runs the entry under entry_key: when the last call ran another, the other
        signatures' plans free their idle arenas first (tracer/signature_switch.py), so a call
        holds its own signature's alone, as its explain() counts. The fast path's repeated
        signature (self._last_fast) never gets here."""
        if entry_key is self._running:
            return
        if self._running is not None and entry_key == self._running:
            self._running = self._shared_entry_key(entry_key)
            return
        self._running = self._shared_entry_key(entry_key)
        with self._lookup_lock:  # iterating hashes keys (Python code): threads move them meanwhile
            entries = tuple(self._entries.items())
        release_other_signatures(entries, entry_key)

    def _count_fast_hit(self, entry_key) -> None:
        self._hits += 1
        if entry_key is not self._most_recent:  # the cache moves it only on a switch
            try:
                self._entries.move_to_end(entry_key)
            except KeyError:  # another thread's call evicted it meanwhile: nothing to move
                return
            self._most_recent = entry_key

    def _shared_entry_key(self, entry_key):
        """The key object the cache holds for this entry: every fast path to it (a tensor and a
        NumPy call of one signature) shares it, so the fast path sees a switch by identity and
        the cache finds the key without comparing it deeply."""
        with self._lookup_lock:  # iterating hashes keys (Python code): threads move them meanwhile
            stored_keys = tuple(self._entries)
        for stored in stored_keys:
            if stored == entry_key:
                return stored
        return entry_key

    def _call_in_trace(self, args: tuple, kwargs: dict):
        """Called while another function is traced: the plan becomes part of that trace."""
        bound, entry = self.lookup(args, kwargs)
        return self._run(entry, bound)

    def lookup(self, args: tuple, kwargs: dict, count_hit: bool = True):
        """(bound call, entry) for these arguments, tracing on a miss. count_hit: a call
        counts a hit; trace() and explain() only look. Threads that miss one signature at once
        trace it once: the others wait for that entry (see _claim)."""
        reads = self._reads
        if reads is not None and reads.changed():
            self._forget_frozen_reads(stacklevel=3)
        bound = self._bind(args, kwargs)
        key, learned_reason = self._learn_dynamic(bound, self._entry_key(bound))
        entry, pending = self._claim(key, count_hit, learned_reason or self._reread)
        if pending is None:
            return bound, self._sized(entry, bound)
        self._reread = None
        forgotten = self._forgotten
        try:
            self._reads = frozen_reads(self.fn)
            entry = self._build_entry(bound)
            with self._lookup_lock:
                self._traces += 1
                if forgotten == self._forgotten:  # else it may have read a rebound variable
                    self._remember(key, entry)
                    self._last_key = key
        finally:
            with self._lookup_lock:
                if self._pending.get(key) is pending:
                    del self._pending[key]
            pending.set()
        self._note_retrace(self._last_miss_reason)
        return bound, self._sized(entry, bound)

    def _build_entry(self, bound):
        """A signature's entry: traced once, or for a symbolic signature a DynamicEntry (its
        first size traced, then probes at other sizes fitted into one plan)."""
        found = self._symbol_of(bound)
        if found is None:
            return self._build(bound)
        call = self._signature_call(bound)
        template, fitted, reason, guards = fit_entry(
            self._build, self._fit, bound, call, found, self._with_call
        )
        return DynamicEntry(
            template, found.symbol, found.size, fitted, reason, self._instantiate, guards
        )

    def _size_switch(self, bound):
        """For a call of a symbolic signature: what tells its DynamicEntry that a call runs at
        this size (switch_to: the other sizes free their idle arenas); None otherwise."""
        if not self._dynamic and not self._learned:
            return None
        symbolic = self._entries.get(self._entry_key(bound))
        if type(symbolic) is not DynamicEntry:
            return None
        size = self._symbol_of(bound).size
        return lambda: symbolic.switch_to(size)

    def _sized(self, entry, bound):
        """The entry for this call's size (itself unless the signature is symbolic)."""
        if type(entry) is not DynamicEntry:
            return entry
        found = self._symbol_of(bound)
        return entry.at(found.size, lambda why: self._trace_size(bound, why))

    def _trace_size(self, bound, why: str):
        """A symbolic signature whose plans do not fit, or not at this size, traces the size
        (why: the retrace reason cache_info and explain give)."""
        entry = self._build(bound)
        with self._lookup_lock:
            self._traces += 1
            self._last_miss_reason = why
        return entry

    def _claim(self, key, count_hit: bool, reason: str | None = None):
        """(entry, None) on a hit, or (stale entry, event) when this thread is to trace `key`.
        While another thread traces the same key this one waits and takes its entry: a wait
        cycle would need a cycle of (function, signature) calls, which never ends anyway; the
        thread tracing a key does not wait for itself (a recursive call traces, as before)."""
        while True:
            with self._lookup_lock:
                entry = self._entries.get(key)
                if entry is not None and self._still_valid(getattr(entry, "template", entry)):
                    self._hits += count_hit
                    self._entries.move_to_end(key)
                    self._most_recent = None
                    return entry, None
                pending = self._pending.get(key)
                if pending is None or pending.owner == threading.get_ident():
                    self._misses += 1
                    self._last_miss_reason = reason or self._miss_reason(key, entry)
                    pending = self._pending[key] = _Tracing()
                    return entry, pending
            pending.wait()  # its entry is in the cache now, or its trace failed: look again

    def _remember(self, key, entry) -> None:
        """Least recently used signatures leave the cache beyond cache_size."""
        self._entries[key] = entry
        self._entries.move_to_end(key)
        self._most_recent = None
        self._loop_watch.active = True  # a new signature: watch its first two calls
        while len(self._entries) > self.cache_size:
            evicted, _ = self._entries.popitem(last=False)
            kept = [(k, v) for k, v in tuple(self._fast.items()) if v.entry_key != evicted]
            self._fast = dict(kept)
            if self._last_fast is not None and self._last_fast.entry_key == evicted:
                self._last_fast = None

    def _note_retrace(self, reason: str | None) -> None:
        """Warn once, after RETRACE_WARNING retraces, with what changed each time."""
        if self._traces > 1:
            self._miss_reasons.append(reason or "unknown")
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

    def trace(self, *args, **kwargs):
        """Trace (or find in the cache) without running: the plans for this signature."""
        if current_trace() is not None:
            raise TracingError("trace() cannot be called inside a traced function")
        return self.lookup(args, kwargs, count_hit=False)[1]

    def profile(self, *args, repeat: int = 5, warmup: int = 3, **kwargs):
        """The measured seconds of each kernel a call runs, in the order of explain's
        report.peak.steps: `report.save_trace(path, times=fn.profile(*args))`. The call runs
        warmup + 1 + 2 * repeat times (donated arguments copied each time). See
        tracer/kernel_profile.py for what a kernel's time includes."""
        from .kernel_profile import profile

        return profile(self, args, kwargs, repeat, warmup)

    def explain(self, *args, **kwargs):
        """The plan for this signature as a report (text, DOT, picture); nothing runs.
        See `backplan.explain`."""
        bound, entry = self.lookup(args, kwargs, count_hit=False)
        with one_listing():  # which kernels are cached: asked for every plan of every size
            return self._explained(entry, bound, args, kwargs)

    def _explained(self, entry, bound, args, kwargs):
        report = self._report(entry, bound)
        report.background_build = self.background is True
        key = (self._shared_entry_key(self._entry_key(bound)), sizes(args, kwargs))
        report.loop_observed = self._loop_watch.observed.get(key)
        report.ran_here = any(
            getattr(getattr(r, "compiled", None), "first_call_seconds", None) is not None
            for r in entry.runners()
        )
        report.max_peak_bytes = getattr(self, "max_peak_bytes", None)
        if entry.planner is not None:
            report.frontier_source = self._planner(entry, bound).memory_frontier
            report.saved_dtype_note = entry.planner.note()
        symbolic = self._entries.get(self._entry_key(bound))
        if type(symbolic) is DynamicEntry:
            size = self._symbol_of(bound).size
            report_of = lambda e: self._report(e, bound)  # noqa: E731
            report.dynamic = dynamic_text(symbolic, report_of, size, report)
        return report

    def memory_frontier(self, *args, **kwargs):
        """The plans a memory budget chooses from for this signature: peak bytes of the whole
        step against the FLOPs each adds by recomputing, the default plan first; nothing runs.
        `print()` it, or `.plot("frontier.png")`. Any point's peak_bytes, given as
        max_peak_bytes, runs that point's plan (or a cheaper one that fits).

        >>> import backplan as bp
        >>> f = bp.value_and_grad(lambda w, x: bp.tanh(bp.tanh(x @ w) @ w).sum())
        >>> w, x = bp.tensor([[0.5, 0.1], [0.2, 0.3]]), bp.tensor([[1.0, 2.0]])
        >>> front = f.memory_frontier(w, x)
        >>> front.points[0].added_flops
        0
        """
        bound, entry = self.lookup(args, kwargs, count_hit=False)
        if entry.planner is None:  # a dynamic axis's size runs the plans fitted over sizes,
            entry = self._build(bound)  # which offer no budget: this size planned alone, as
        return self._planner(entry, bound).memory_frontier()  # max_peak_bytes plans it

    def _planner(self, entry, bound):
        """The entry's budget planner for this call (bp.compile: for its NumPy arguments)."""
        return entry.planner

    def _plan_runners(self) -> list:
        """The runners every cached signature's plans made so far (a signature's backward
        plans make theirs at its first backward())."""
        return [r for entry in list(self._entries.values()) for r in entry.runners()]

    @property
    def driver_tier(self) -> str | None:
        """What the slowest of its plans runs on now: "reference" (the reference interpreter,
        while a background build compiles it), "python" (the driver as Python calling compiled
        kernels) or "compiled"; None before a call made any plan."""
        return slowest_tier(self._plan_runners())

    def wait_until_compiled(self, timeout: float | None = None) -> bool:
        """Wait for the background builds of the plans made so far; True when all of them now
        run compiled code, False if one cannot (its build failed: a DriverBuildWarning said
        why) or `timeout` seconds passed first. Calls stay correct either way.

        >>> import backplan as bp
        >>> double = bp.compile(lambda x: x * 2.0, background=True)
        >>> double.wait_until_compiled(timeout=0)  # nothing called yet, nothing compiled
        False
        """
        return wait_until_compiled(self._plan_runners(), timeout)

    def cache_info(self) -> CacheInfo:
        return CacheInfo(
            self._traces, self._hits, self._misses, self._last_miss_reason, len(self._entries)
        )

    def clear_cache(self) -> None:
        self._running = None
        self._entries.clear()
        self._fast.clear()
        self._last_fast = None
        self._most_recent = None
