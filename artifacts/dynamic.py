"""Artifacts with a dynamic axis (as jax.export's shape polymorphism): `bp.export(fn, ...,
dynamic={"x": {0: "batch"}})` stores the plans at the example's size n and at 2n and 3n; bp.load
fits them again into one plan of the symbol (ir/symbolic.py) and the loaded function runs any
size of 2 or more on those axes, instantiating the plan per size (no trace, no source). Sizes 0
and 1 get plans of their own, as in the compiled function (a size-1 axis broadcasts), traced at
export time and stored beside the others, so the artifact takes every size."""

from __future__ import annotations

import copy

from backplan.ir.symbolic import SymbolicError, fit_plans
from backplan.ir.symbolic_regions import fit_regions
from backplan.tracer.dynamic import PROBE_FACTORS, DynamicEntry, checked_dynamic, resized_call
from backplan.tracer.planned import PlannedFunction
from backplan.tracer.source import loc_text
from backplan.tracer.traced_size import guard_text

from .format import ExportError

SPECIAL_SIZES = (1, 0)  # sizes planned on their own (tracer/dynamic.find_symbol)
MAX_REASON = 300  # characters kept of why a size could not be exported


def with_dynamic(fn, dynamic):
    """fn with these dynamic axes declared (an empty cache of its own), or fn itself when
    dynamic is None (then the axes fn declared with bp.compile(dynamic=...), if any)."""
    if dynamic is None:
        return fn
    inner = getattr(fn, "_parameters", None)
    names = inner if inner is not None else _names(fn)
    spec = checked_dynamic(dynamic, names)
    if getattr(fn, "max_peak_bytes", None) is not None:
        raise ExportError("export(dynamic=...) of a function with a memory budget")
    other = copy.copy(fn)
    PlannedFunction.__init__(other, fn.fn, fn.cache_size, fn.background)
    other._static_nums, other._static_names = fn._static_nums, fn._static_names
    other._dynamic = spec
    if hasattr(other, "_parameters"):
        other._parameters = names
    return other


def _names(fn) -> list[str] | None:
    import inspect

    try:
        return list(inspect.signature(getattr(fn.fn, "fn", fn.fn)).parameters)
    except (TypeError, ValueError):
        return None


def dynamic_meta(fn, bound, writer, roles_at, special_at) -> dict | None:
    """meta.json's "dynamic": the symbol, the sizes stored, the (leaf, axis) places, the
    plans at 2n and 3n (roles_at(fitted, size) -> {role: plan}) and at sizes 1 and 0
    (special_at(entry traced at that size, size) -> meta fields); None for a fixed signature."""
    found = fn._symbol_of(bound)
    entry = fn._entries.get(fn._entry_key(bound)) if found is not None else None
    if type(entry) is not DynamicEntry:
        return None
    if entry.fitted is None:
        raise ExportError(
            f"cannot export axis {entry.symbol} as dynamic: {entry.reason}; export one size "
            "(without dynamic=) per size you need"
        )
    if entry.guards is not None and entry.guards.checks:
        expr, want, loc = entry.guards.checks[0]
        raise ExportError(
            f"cannot export axis {entry.symbol} as dynamic: the function decides on a size it "
            f"reads ({guard_text(expr)} at {loc_text(loc)}), which the artifact cannot check "
            "again at another size; export one size (without dynamic=) per size you need"
        )
    sizes = [found.size * f for f in (1, *PROBE_FACTORS)]
    plans = {
        str(n): {
            role: writer.add_plan(f"{role}_at_{n}", plan)
            for role, plan in roles_at(entry.fitted, n).items()
        }
        for n in sizes[1:]
    }
    return {
        "symbol": entry.symbol,
        "sizes": sizes,
        "places": [list(place) for place in found.places],
        "plans": plans,
        "special": {str(n): _special(fn, bound, found, n, special_at) for n in SPECIAL_SIZES},
    }


def _special(fn, bound, found, size: int, special_at) -> dict:
    """The meta fields of the plans traced at `size` (shape-only arguments: nothing runs), or
    {"refused": why} when the function cannot be traced there (a call at that size then says
    so, as the compiled function would have failed there too)."""
    call = fn._with_call(bound, resized_call(fn._signature_call(bound), found, size))
    try:
        return special_at(fn._build(call), size)
    except Exception as exc:  # noqa: BLE001 - any failure at this size is that size's answer
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return {"refused": f"{type(exc).__name__}: {first}"[:MAX_REASON]}


def fit_loaded(kind: str, template_plans, probe_plans: list, sizes: list[int]):
    """The fitted plans of a loaded artifact (a tampered one does not fit: ExportError)."""
    try:
        if kind == "compiled":
            return fit_regions([template_plans, *probe_plans], sizes)
        return fit_plans([template_plans, *probe_plans], sizes)
    except SymbolicError as exc:
        raise ExportError(f"meta.json dynamic: the stored plans are not one plan ({exc})") from None
