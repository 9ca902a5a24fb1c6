"""What every planned function shares: `bp.compile`, `bp.value_and_grad` / `bp.grad` and the
functions `bp.load` returns keep traced plans per signature, count hits and misses, say why
the last miss happened, skip argument binding on repeat calls, and answer trace() and
explain(). Subclasses say only how a call is bound, how an entry is built, run and reported."""

from __future__ import annotations

from dataclasses import dataclass

from backplan.runtime import is_grad_enabled

from .errors import TracingError
from .fastpath import call_key
from .trace import current_trace

STALE = object()  # a fast-path runner's answer when its entry no longer fits the call


@dataclass
class CacheInfo:
    traces: int
    hits: int
    misses: int
    last_miss_reason: str | None
    entries: int


class PlannedFunction:
    """A function run through plans traced once per signature (see the module docstring)."""

    def __init__(self, fn):
        self.fn = fn
        self._entries: dict = {}  # entry key -> traced entry
        self._fast: dict = {}  # fastpath.call_key -> runner(leaves) (or STALE)
        self._traces = self._hits = self._misses = 0
        self._last_key = None
        self._last_miss_reason: str | None = None

    # ---- what subclasses provide -------------------------------------------------------------

    def _bind(self, args: tuple, kwargs: dict):
        """The bound call: whatever _build, _run and _report need."""
        raise NotImplementedError

    def _entry_key(self, bound):
        return bound.key

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

    def __call__(self, *args, **kwargs):
        if current_trace() is not None:
            return self._call_in_trace(args, kwargs)
        key, leaves = call_key(args, kwargs, is_grad_enabled())
        runner = self._fast.get(key) if key is not None else None
        if runner is not None:
            result = runner(leaves)
            if result is not STALE:
                self._hits += 1
                return result
        bound, entry = self.lookup(args, kwargs)
        result = self._run(entry, bound)
        if key is not None:
            runner = self._fast_runner(entry, bound, leaves)
            if runner is not None:
                self._fast[key] = runner
        return result

    def _call_in_trace(self, args: tuple, kwargs: dict):
        """Called while another function is traced: the plan becomes part of that trace."""
        bound, entry = self.lookup(args, kwargs)
        return self._run(entry, bound)

    def lookup(self, args: tuple, kwargs: dict, count_hit: bool = True):
        """(bound call, entry) for these arguments, tracing on a miss. count_hit: a call
        counts a hit; trace() and explain() only look."""
        bound = self._bind(args, kwargs)
        key = self._entry_key(bound)
        entry = self._entries.get(key)
        if entry is not None and self._still_valid(entry):
            self._hits += count_hit
            return bound, entry
        self._misses += 1
        self._last_miss_reason = self._miss_reason(key, entry)
        entry = self._build(bound)
        self._traces += 1
        self._entries[key] = entry
        self._last_key = key
        return bound, entry

    def trace(self, *args, **kwargs):
        """Trace (or find in the cache) without running: the plans for this signature."""
        if current_trace() is not None:
            raise TracingError("trace() cannot be called inside a traced function")
        return self.lookup(args, kwargs, count_hit=False)[1]

    def explain(self, *args, **kwargs):
        """The plan for this signature as a report (text, DOT, picture); nothing runs.
        See `backplan.explain`."""
        bound, entry = self.lookup(args, kwargs, count_hit=False)
        return self._report(entry, bound)

    def cache_info(self) -> CacheInfo:
        return CacheInfo(
            self._traces, self._hits, self._misses, self._last_miss_reason, len(self._entries)
        )

    def clear_cache(self) -> None:
        self._entries.clear()
        self._fast.clear()
