"""Dynamic axes: one cache entry, one trace and one compiled plan for every size of an axis.

`bp.compile(fn, dynamic={"x": {0: "batch"}})` declares that axis 0 of every tensor in argument
`x` is the symbol `batch`. The signature then keys on the symbol instead of the size, so every
batch size finds the same entry. The entry is traced at the size of the first call and at three
probe sizes (2x, 3x and 2x + 1: tracing needs shapes, not data, and nothing compiles);
ir/symbolic.py fits the four plans into one whose sizes are formulas of the symbol, and each new
size is that plan instantiated (no trace, the same kernels and driver). Sizes 0 and 1 stay
concrete, as torch.compile specialises them: a size-1 axis broadcasts and must not be taken for
the symbol.
Where the plans do not fit (the function branches on the size, builds arrays from it, reshapes
batch into another axis in a way that is not a formula), every size gets its own trace, as
without `dynamic`, and `reason` says why in one line (explain prints it)."""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, replace

import numpy as np

from backplan.ir import update_order
from backplan.ir.argument_layout import any_size
from backplan.ir.gc_pause import paused_gc
from backplan.ir.symbolic import Affine, SymbolicError, fit_number
from backplan.runtime.backend import offer_arenas

from .errors import TracingError
from .signature import BoundCall, SignatureKey
from .source import loc_text, user_frame_loc
from .traced_size import Guards, fit_guards, reading_sizes

PROBE_FACTORS = (2, 3)  # the probe sizes, as multiples of the first size (keeps divisibility)


def checking_size(first: int) -> int:
    """A last probe that shares no divisor with the first size (gcd(2s + 1, s) = 1): integer
    arithmetic on the size that multiples of it cannot tell apart (x[: n // 4 * 4] traced at
    16, 32 and 48 is x[:n]) shows there as a number that is not one formula."""
    return 2 * first + 1


SIZES_KEPT = 16  # instantiated sizes an entry keeps (least recently used leave first)


def checked_dynamic(dynamic, parameters) -> dict[str, dict[int, str]]:
    """dynamic= as {argument name: {axis: symbol}}, refused by name when malformed."""
    if dynamic is None or dynamic is False:
        return {}
    if dynamic is True:  # torch.compile's spelling: every axis dynamic
        raise TypeError(
            "dynamic=True (torch.compile's every axis dynamic) is not supported: one symbol, "
            "on the axes you name: dynamic={'x': {0: 'batch'}}; the default (None) makes an "
            "axis dynamic by itself at the second size seen on it"
        )
    if not isinstance(dynamic, dict):
        raise TypeError(
            f"dynamic must be a dict like {{'x': {{0: 'batch'}}}}, got {type(dynamic).__name__}"
        )
    checked: dict[str, dict[int, str]] = {}
    for name, axes in dynamic.items():
        if parameters is not None and name not in parameters:
            raise ValueError(
                f"dynamic names argument {name!r}, which the function does not take "
                f"(its arguments: {', '.join(parameters)})"
            )
        if not isinstance(axes, dict) or not all(
            isinstance(a, int) and isinstance(s, str) and s.isidentifier() for a, s in axes.items()
        ):
            raise TypeError(f"dynamic[{name!r}] must map axes to symbol names, e.g. {{0: 'batch'}}")
        checked[name] = dict(axes)
    symbols = {s for axes in checked.values() for s in axes.values()}
    if len(symbols) > 1:
        raise ValueError(
            f"dynamic names {len(symbols)} symbols ({', '.join(sorted(symbols))}); one symbol "
            "per function is supported (axes that share it always have the same size)"
        )
    return checked


@dataclass(frozen=True)
class SymbolicCall:
    """Where the symbol sits in one call: its name, its size, and the (leaf, axis) pairs."""

    symbol: str
    size: int
    places: tuple[tuple[int, int], ...]  # (leaf position in the bound call, axis)


def find_symbol(
    call: BoundCall, declared: dict[str, dict[int, str]], argument_of=None, learned=None
) -> SymbolicCall | None:
    """The symbol of this call, or None when no declared axis is there or its size is 0 or 1
    (specialised: a plan of its own). argument_of(call, p): the parameter name of leaf p.
    learned: {leaf path: (rank, axis, symbol)} made dynamic automatically (learn_axis)."""
    found: dict[str, int] = {}
    places = []
    for p in call.tensor_positions:
        axes = None
        if declared:
            name = call.arguments[p] if argument_of is None else argument_of(call, p)
            axes = declared.get(name)
        leaf = call.key.leaves[p]
        if learned and leaf.path in learned and not leaf.weak:
            rank, axis, symbol = learned[leaf.path]
            axes = {axis: symbol} if len(leaf.shape) == rank else axes
        if not axes or leaf.weak:
            continue
        for axis, symbol in axes.items():
            if not -len(leaf.shape) <= axis < len(leaf.shape):
                raise TracingError(
                    f"dynamic axis {axis} of argument {leaf.path}: it has shape "
                    f"{tuple(leaf.shape)}, with no axis {axis}"
                )
            size = leaf.shape[axis]
            if size in (0, 1):
                return None
            seen = found.setdefault(symbol, size)
            if seen != size:
                raise TracingError(
                    f"dynamic axis {symbol!r}: {leaf.path} has size {size} on axis {axis} "
                    f"where another argument has {seen}; axes sharing a symbol share one size "
                    f"(the call at {loc_text(user_frame_loc())})"
                )
            places.append((p, axis % len(leaf.shape)))
    if not found:
        return None
    ((symbol, size),) = found.items()
    return SymbolicCall(symbol, size, tuple(places))


def sizes_planned_apart(option: str) -> str:
    """The retrace reason's note where a memory budget keeps automatic dynamic axes off: a
    user who saw one plan for every size without the budget learns why each size traces."""
    return (
        f"no axis becomes dynamic under {option}: which plan fits depends on the size, so "
        "each size is planned on its own"
    )


def learn_axis(new: SignatureKey, cached) -> dict | None:
    """{leaf path: (rank, axis, symbol)} when `new` differs from a cached signature only in
    sizes, all of one axis size m -> n (both at least 2): the second size seen on that axis,
    after which it is dynamic (torch.compile's automatic dynamic shapes). None otherwise: a
    change of two sizes, of anything else, or to a size 0 or 1 retraces as before."""
    for old in cached:
        if old.treedef != new.treedef or len(old.leaves) != len(new.leaves):
            continue
        changed = _size_changes(old, new)
        if changed is None or len({(m, n) for _, _, _, m, n in changed}) != 1:
            continue
        path, rank, axis, m, n = changed[0]
        if min(m, n) < 2:
            continue
        symbol = f"{path}.shape[{axis}]"
        return {p: (r, a, symbol) for p, r, a, _, _ in changed}
    return None


def takes_symbol(key: SignatureKey, learned: dict) -> bool:
    """Whether calls of this signature find the symbol of `learned` (as find_symbol does: a
    leaf on a learned axis, every such size 2 or more), so their own plan is never looked up."""
    sizes = [
        leaf.shape[learned[leaf.path][1]]
        for leaf in key.leaves
        if leaf.path in learned and not leaf.weak and len(leaf.shape) == learned[leaf.path][0]
    ]
    return bool(sizes) and all(isinstance(n, int) and n >= 2 for n in sizes)


def _size_changes(old: SignatureKey, new: SignatureKey) -> list | None:
    """[(path, rank, axis, old size, new size)] where only tensor sizes differ, else None."""
    changes = []
    for a, b in zip(old.leaves, new.leaves, strict=True):
        if a == b:
            continue
        if a.kind != "tensor" or b.kind != "tensor" or len(a.shape) != len(b.shape):
            return None
        if replace(a, shape=b.shape, layout=any_size(a.layout)) != replace(
            b, layout=any_size(b.layout)
        ):  # a sliced view's word names its sizes
            return None
        for axis, (m, n) in enumerate(zip(a.shape, b.shape, strict=True)):
            if m != n:
                if not isinstance(m, int):  # already a symbol there
                    return None
                changes.append((b.path, len(b.shape), axis, m, n))
    return changes or None


def symbolic_key(key: SignatureKey, found: SymbolicCall) -> SignatureKey:
    """The signature with the symbol's name where its sizes were."""
    leaves = list(key.leaves)
    for p, axis in found.places:
        leaf = leaves[p]
        shape = list(leaf.shape)
        shape[axis] = found.symbol
        leaves[p] = replace(leaf, shape=tuple(shape), layout=any_size(leaf.layout))
    return SignatureKey(key.treedef, tuple(leaves))


class _ShapeOnly:
    """A probe's argument: tracing reads a tensor's shape and dtype, never its data."""

    def __init__(self, shape: tuple, dtype: str):
        self.shape = shape
        self._ir_dtype = dtype


def resized_call(call: BoundCall, found: SymbolicCall, size: int) -> BoundCall:
    """The call with the symbol's axes at another size, for a probe trace."""
    leaves, keys = list(call.leaves), list(call.key.leaves)
    for p, axis in found.places:
        shape = list(keys[p].shape)
        shape[axis] = size
        keys[p] = replace(keys[p], shape=tuple(shape), layout=any_size(keys[p].layout))
        leaves[p] = _ShapeOnly(tuple(shape), keys[p].dtype)
    key = SignatureKey(call.key.treedef, tuple(keys))
    return replace(call, key=key, leaves=leaves)


class DynamicEntry:
    """The cache entry of a symbolic signature: the entry traced at the first size (template),
    the fitted plans (or the reason there are none), and the entries instantiated per size."""

    def __init__(self, template, symbol, size, fitted, reason, make, guards: Guards | None = None):
        self.template = template
        self.guards = guards  # what a size must repeat of the user's code (traced_size.py)
        self.decided_apart: dict[int, str] = {}  # size -> the guard it fails (its own plan)
        self.symbol = symbol
        self.first_size = size
        self.fitted = fitted  # what make(template, fitted, n) instantiates; None: per size
        self.reason = reason  # why each size is planned on its own, or None
        self._make = make
        self._sizes: OrderedDict = OrderedDict({size: template})
        self._lock = threading.Lock()
        self.planner = None  # memory budgets are not offered on a symbolic signature
        self._current = size  # the size the last call ran at (switch_to)
        self._evicted: list = []  # (size, weak runner) of sizes no longer kept (switch_to)

    def at(self, size: int, trace_one):
        """The entry at this size: instantiated from the fitted plans, or (when there are
        none) traced by trace_one(why) like any other signature (why: the retrace reason)."""
        with self._lock:
            entry = self._sizes.get(size)
            if entry is not None:
                self._sizes.move_to_end(size)
                return entry
        failed = self.guards.hold_at(size) if self.fitted is not None and self.guards else None
        if self.fitted is None or failed is not None:
            why = (  # per size; or the user's code decides otherwise at this size
                f"{self.symbol}={size} is planned on its own: {self.reason}"
                if failed is None
                else f"at {self.symbol}={size} the function decides otherwise than where it "
                f"was traced ({failed})"
            )
            entry = trace_one(why)
            if failed is not None:
                with self._lock:
                    self.decided_apart[size] = failed
        else:  # a new size's plan, lowered and rendered paused too (runtime/backend.py): its
            # objects outlive the call, and a collection promoting them walked every size's
            # plans (a full collection of 30-50 ms on one new size's first call in a few)
            try:
                with paused_gc():
                    entry = self._make(self.template, self.fitted, size)
            except SymbolicError as out:  # a slice's fitted bounds outside this size's axis
                try:
                    entry = trace_one(f"the plan for every {self.symbol} does not hold: {out}")
                except Exception as exc:  # a loaded artifact traces nothing: say why it refuses
                    exc.add_note(f"the plan for every {self.symbol} does not hold: {out}")
                    raise
        with self._lock:
            entry = self._sizes.setdefault(size, entry)
            while len(self._sizes) > SIZES_KEPT:
                self._evict(*self._sizes.popitem(last=False))
        return entry

    def switch_to(self, size: int) -> bool:
        """A call runs at `size`: when the last one ran at another, every other size's plans
        free the scratch arenas they keep idle (made again when that size comes back), so a
        call holds its own size's arenas alone, as explain's peak for the size counts. A
        switch costs the next call at the other size one arena allocation, which grows over
        the freed arenas' pages (offered: codegen/run/arena_memory.py; the caller withdraws
        offers its call did not take: True when it offered any)."""
        if self._current == size:
            return False
        self._current = size
        runners = [r for _, other in self.others(size) for r in _arena_holders(other)]
        with self._lock:
            runners += [ref() for n, ref in self._evicted if n != size]
        freed = []
        for runner in runners:
            release = getattr(runner, "release_idle", None)
            if release is not None:
                freed += release() or ()
        if freed:
            offer_arenas(freed)
        return bool(freed)

    def arena_holders(self) -> list:
        """The runners of every size, kept or evicted but still alive, that may keep arenas:
        a call of another signature frees their idle ones (tracer/signature_switch.py)."""
        runners = [r for _, entry in self.others(None) for r in _arena_holders(entry)]
        with self._lock:
            evicted = [ref() for _, ref in self._evicted]
        return runners + [r for r in evicted if r is not None]

    def _evict(self, size: int, entry) -> None:
        """A size leaves the kept ones (under self._lock). Its runners may live on where a
        caller's fast path holds them (tracer/planned.py keeps one per size seen), and run
        again, keeping their arenas: switch_to frees those too, so that a call still holds its
        own size's arenas alone (a call at 10 rows after 18 sizes held the first two sizes'
        arenas, 520 B beyond explain's peak)."""
        self._evicted = [(n, ref) for n, ref in self._evicted if ref() is not None]
        for runner in _arena_holders(entry):
            try:
                self._evicted.append((size, weakref.ref(runner)))
            except TypeError:  # cannot be referred to weakly: keeps nothing (the interpreter)
                pass

    def sizes(self) -> list[int]:
        with self._lock:
            return list(self._sizes)

    def runners(self) -> list:
        with self._lock:
            entries = list(self._sizes.values())
        return [r for e in entries for r in e.runners()]

    def others(self, size: int) -> list:
        """(size, entry) of every size kept besides `size`, smallest first."""
        with self._lock:
            return sorted((n, e) for n, e in self._sizes.items() if n != size)


def _arena_holders(entry) -> list:
    """The runners of a size's entry that may keep arenas: its plans' (forward, each backward
    mode, value_and_grad's joint plan) and a compiled step's joint plan (runtime/joint_step)."""
    runners = list(entry.runners())
    joint = getattr(getattr(entry, "program", None), "joint_step", None)
    return runners + joint.runners() if joint is not None else runners


def fit_entry(build, fit, bound, call: BoundCall, found: SymbolicCall, with_call):
    """(template entry, fitted plans or None, reason or None, guards or None): the template
    traced at the call's size, the probes at 2x, 3x and checking_size, their fit, and what
    the user's code did with the sizes it read (tracer/traced_size.py), which every other
    size must repeat for the fitted plans to hold there. with_call(bound, call) is the bound
    call a subclass's build takes for a resized signature call."""
    with reading_sizes() as first:
        template = build(bound)
    sizes = [found.size] + [found.size * f for f in PROBE_FACTORS] + [checking_size(found.size)]
    logs = [first]
    try:
        with update_order.following(_update_order_kept(template)):
            probes = []
            for n in sizes[1:]:
                with reading_sizes() as log:
                    probes.append(build(with_call(bound, resized_call(call, found, n))))
                logs.append(log)
    except Exception as exc:  # noqa: BLE001 - a probe that fails only means: per size
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return template, None, f"tracing at {found.symbol}={sizes[1]} failed ({first_line})", None
    for probe, n in zip(probes, sizes[1:], strict=True):
        changed = captured_change(template.captured, probe.captured) or _returned_change(
            template, probe
        )
        if changed is not None:  # the fitted plan would read the first size's array
            return template, None, f"{changed} at {found.symbol}={sizes[0]} and {n}", None
    try:
        fitted = fit([template, *probes], sizes)
        return template, fitted, None, fit_guards(logs, sizes, found.symbol)
    except SymbolicError as exc:
        return template, None, str(exc), None


def captured_change(first: list, other: list) -> str | None:
    """None when two traces of one function captured the same tensors: the same objects, or
    arrays of equal dtype, shape and values (a NumPy array the function reads is a new tensor
    at each trace); else what differs. An array made from the size (np.arange(x.shape[0]))
    differs: one plan for every size would read the first size's array at every size."""
    if len(first) != len(other):
        return f"the function captures {len(first)} arrays at one size, {len(other)} at another"
    for i, (a, b) in enumerate(zip(first, other, strict=True)):
        if a is not b and not _equal_arrays(a, b):
            return (
                f"captured array {i} (shape {a.shape}, {a._ir_dtype}) changes with the size (an "
                "array made from the size, e.g. np.arange(x.shape[0]))"
            )
    return None


def _returned_change(first, other) -> str | None:
    """What differs between two traces' Python values among the results (`return loss,
    x.shape[0]`): the fitted plan would return the first size's value at every size."""
    slots = [getattr(e, "out_slots", None) for e in (first, other)]
    if slots[0] is None or slots[1] is None:
        return None
    for i, (a, b) in enumerate(zip(*slots, strict=True)):
        if a[0] == "static" and b[0] == "static" and a[1] != b[1]:
            return f"result {i} is the Python value {a[1]!r} at one size, {b[1]!r} at another"
    return None


def _equal_arrays(a, b) -> bool:
    if a._data is None or b._data is None:  # a tracer of an enclosing trace: only itself
        return False
    if (a._ir_dtype, a.shape, a._requires_grad) != (b._ir_dtype, b.shape, b._requires_grad):
        return False
    x, y = np.asarray(a._data), np.asarray(b._data)
    return bool(np.array_equal(x, y, equal_nan=x.dtype.kind in "fc"))


def _update_order_kept(entry) -> bool | None:
    """Whether a compiled training step's plan runs its updates right after their gradients
    (ir/update_order.py; None: no such choice, or the entry is value_and_grad's)."""
    plans = getattr(getattr(entry, "program", None), "plans", None)
    order = getattr(plans, "update_order", None)
    return None if order is None else order.kept


def dynamic_text(entry: DynamicEntry, report_of, size: int, report) -> str:
    """What explain says of a symbolic signature: its symbol, the sizes planned, and the
    step's peak and saved bytes as formulas of the symbol, fitted from the plan at three sizes
    (where the bytes are not exactly one formula, the value at this size and an approximate
    formula, saying so)."""
    symbol, sizes = entry.symbol, ", ".join(str(n) for n in sorted(entry.sizes()))
    if entry.fitted is None:
        return (
            f"Dynamic axis {symbol}: each size is planned on its own (sizes {sizes}), "
            f"because {entry.reason}."
            + _other_sizes_arenas(entry, report_of, size, report)
            + _loop_results(entry, report_of, size, report)
        )
    apart = _decided_apart(entry, size)
    if size in entry.decided_apart:
        return apart + _other_sizes_arenas(entry, report_of, size, report)
    at = [entry.first_size * f for f in (1, *PROBE_FACTORS)]
    reports = [report_of(entry._make(entry.template, entry.fitted, n)) for n in at]
    formulas = []
    for what, attr in (("peak", "peak_bytes"), ("saved", "saved_bytes")):
        values = [getattr(r, attr) for r in reports]
        formulas.append(f"{what} = {_formula(values, at, symbol, getattr(report, attr), size)}")
    return (
        f"Dynamic axis {symbol}: one plan for every size, traced once at "
        f"{symbol}={entry.first_size}, planned for sizes {sizes}; {'; '.join(formulas)}. "
        "A new size compiles no kernel: the loops take their sizes as arguments, and a plan's "
        "direct driver (from its second call) reads each size's numbers when it runs, made once "
        "for every size (at the first size, or at the second where loops over axes of a few "
        "elements are compiled at the sizes the two share)."
        + (" " + apart if apart else "")
        + _other_sizes_arenas(entry, report_of, size, report)
        + _loop_results(entry, report_of, size, report)
    )


def _decided_apart(entry: DynamicEntry, size: int) -> str:
    """The sizes traced on their own because the function's code decides otherwise there
    (tracer/traced_size.py guards): the one plan's formulas do not describe them."""
    with entry._lock:
        apart = dict(entry.decided_apart)
    if not apart:
        return ""
    if size in apart:
        return (
            f"Dynamic axis {entry.symbol}: at {entry.symbol}={size} the function decides "
            f"otherwise than where it was traced ({apart[size]}), so this size is traced and "
            "planned on its own; this report's figures are that plan's."
        )
    sizes = ", ".join(str(n) for n in sorted(apart))
    which = f"Sizes {sizes} run plans" if len(apart) > 1 else f"Size {sizes} runs a plan"
    return (
        f"{which} of their own: the function decides otherwise there "
        f"({entry.symbol}={min(apart)}: {apart[min(apart)]})."
    ).replace("a plan of their own", "a plan of its own")


def _other_sizes_arenas(entry: DynamicEntry, report_of, size: int, this) -> str:
    """Each size keeps its own compiled plans and their scratch arenas while it is cached; a
    call at one size frees the other sizes' idle arenas (DynamicEntry.switch_to), so the peak
    above is all a call at this size holds (a joint plan, once it runs, has freed the two
    plans' arenas, and explain counts them as gone). Says so, with the arenas a switch frees."""
    kept = []
    for n, other in entry.others(size):
        report = report_of(other)
        joint = report.joint_step_facts
        nbytes = (report.compiled_scratch_bytes or 0) + (joint.scratch_bytes if joint else 0)
        if nbytes:
            kept.append((n, nbytes))
    if not kept:
        return ""
    each = ", ".join(f"{n}: {b:,} B" for n, b in kept)
    text = (
        f" A call at {size} first frees the scratch arenas the other sizes keep idle ({each}; "
        "made again when a size comes back), so the peak above is all it holds."
    )
    return text


def _loop_results(entry: DynamicEntry, report_of, size: int, this) -> str:
    """In a loop that keeps the last results, a call after one at another size holds that
    size's results, not its own size's (report.loop_peak_on_call(n, kept=...))."""
    kept = [(n, report_of(other).kept_output_bytes(1)) for n, other in entry.others(size)]
    if not any(b for _, b in kept):
        return ""
    each = ", ".join(f"{n}: {b:,} B" for n, b in kept)
    return (
        f" In a loop that keeps the last results, a call after one at another size holds that "
        f"call's results ({each}) instead of {this.kept_output_bytes(1):,} B at {size} "
        "(report.loop_peak_on_call(n, kept=...))."
    )


def _formula(values: list[int], sizes: list[int], symbol: str, here: int, size: int) -> str:
    """The bytes as a formula of the symbol where it gives this size's bytes too; else this
    size's bytes and the formula as approximate. The peak is the largest of each step's
    bytes, so below some size another step may hold it, on another slope, and arenas pad
    small buffers: a formula fitted at three sizes need not hold at a fourth."""
    try:
        fitted, fits = fit_number(values, sizes, ""), True
    except SymbolicError:
        c = round((values[2] - values[1]) / (sizes[2] - sizes[1]))
        fitted, fits = Affine(values[2] - c * sizes[2], c), False
    exact = fitted.at(size) if isinstance(fitted, Affine) else fitted
    text = fitted.text(symbol) if isinstance(fitted, Affine) else f"{fitted:,}"
    if fits and exact == here:
        return f"{text} bytes"
    return (
        f"{here:,} bytes at {symbol}={size} (about {text}: not exactly one formula, the step "
        "that peaks and the arenas' packing change with the size)"
    )
