"""Saved buffers counted once. One array can be saved by several regions (eager `x *
bp.exp(x)`: exp saves its output and mul saves the same array as its input), and some saved
buffers are the user's own arrays, which no graph allocated. Totals here count each array
once and keep the user's arrays apart from what the graphs allocated."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SavedTotals:
    """allocated: bytes of the distinct arrays the graphs made; yours: bytes of your own arrays
    (passed in, or leaf tensors) that the graphs keep references to."""

    allocated: int = 0
    yours: int = 0


def held_totals(regions) -> SavedTotals:
    """What the regions hold now: each array once (by its memory), yours apart."""
    seen: dict[tuple[int, int], bool] = {}
    for region in regions:
        for array, yours in region.held_arrays():
            key = (array.__array_interface__["data"][0], array.nbytes)
            seen[key] = seen.get(key, False) or yours
    return _totals((nbytes, yours) for (_, nbytes), yours in seen.items())


def planned_totals(regions) -> SavedTotals:
    """What the regions saved before anything was freed: a buffer one region saves as its
    output and the next saves as its input is one buffer (matched through the graph's edges,
    so it holds after the arrays are gone)."""
    seen: dict[tuple, tuple[int, bool]] = {}
    for region in regions:
        for key, nbytes, yours in region.saved_keys():
            seen[key] = (nbytes, yours)
    return _totals(seen.values())


def _totals(pairs) -> SavedTotals:
    allocated = yours = 0
    for nbytes, is_yours in pairs:
        if is_yours:
            yours += nbytes
        else:
            allocated += nbytes
    return SavedTotals(allocated, yours)
