"""A call of one signature frees the scratch arenas the function's other signatures keep idle.

Each signature (a shape or dtype of the arguments, a static value) has its own plans, and a
compiled plan keeps its arena between calls (codegen/run/workspace.py). explain() of a
signature counts that signature's plans alone, so a function called with two signatures in
turn held the other one's arenas beyond the printed peak. Now a call entering a signature other
than the last call's first lets the others' idle workspaces go (made again when their
signature comes back: one arena allocation per switch), as a dynamic axis's sizes do
(DynamicEntry.switch_to). Only idle workspaces are freed: a call running in another thread
keeps its own.
"""

from __future__ import annotations

from .dynamic import DynamicEntry, _arena_holders


def release_other_signatures(entries, key) -> None:
    """Free the idle arenas of every cached entry but the one under `key` (entries: (entry key,
    entry) pairs of a PlannedFunction's cache, read under its lock: iterating the OrderedDict's
    items calls each key's __hash__, Python code, so another thread could move an entry
    meanwhile and the iteration raised `OrderedDict mutated during iteration`)."""
    for stored, entry in entries:
        if stored is key or stored == key:
            continue
        release_idle_arenas(entry)


def release_idle_arenas(entry) -> None:
    """Free the scratch arenas a cache entry's plans keep idle (a call running them in another
    thread keeps its own)."""
    holders = entry.arena_holders() if type(entry) is DynamicEntry else _arena_holders(entry)
    for runner in holders:
        release = getattr(runner, "release_idle", None)
        if release is not None:
            release()
