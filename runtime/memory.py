"""Accounting of the bytes all live graphs hold in saved buffers."""

import sys
import threading
import weakref

# Weak references without callbacks, one per region, appended as regions are made: a WeakSet's
# add and its removal callback cost every recorded call ~0.8 us of Python, and a dict keyed by
# id with a lock around each store still ~0.5 us (one compiled step's forward and backward()
# make one region). list.append is one step under the GIL, so track takes no lock; the sweep,
# once the list has doubled since the last one, takes _lock against another sweep and replaces
# only the entries it read, in one slice assignment, so appends made meanwhile stay.
_live_regions: list = []
_lock = threading.Lock()  # one sweep at a time
_sweep_at = 1024


def track(region) -> None:
    _live_regions.append(weakref.ref(region))
    if len(_live_regions) >= _sweep_at:
        _sweep()


def _sweep() -> None:
    global _sweep_at
    with _lock:
        count = len(_live_regions)
        if count < _sweep_at:  # another thread swept first
            return
        alive = [ref for ref in _live_regions[:count] if ref() is not None]
        _live_regions[:count] = alive  # the entries appended since the copy stay after these
        _sweep_at = max(1024, 2 * len(_live_regions))


def live_regions() -> list:
    refs = _live_regions[:]  # one step under the GIL, as an append or a sweep's replacement
    return [region for region in (ref() for ref in refs) if region is not None]


def live_saved_bytes(yours: bool = False) -> int:
    """Bytes of the saved buffers every graph still alive has allocated, each array counted
    once however many regions save it; your own arrays (passed in, leaf tensors) that graphs
    keep references to are not among them: `live_saved_bytes(yours=True)` gives those. The
    copy a compiled call takes of a NumPy array you pass, where its backward reads it, is the
    graph's own: counted here, not in yours. Drops to 0 once each graph has run backward
    (without retain_graph) or has been released.

    >>> import backplan as bp
    >>> bp.live_saved_bytes() >= 0
    True
    """
    from .saved_once import held_totals

    totals = held_totals(live_regions())
    return totals.yours if yours else totals.allocated


def output_reuse_check():
    """codegen/run/workspace.py's kept_only_for_reuse (whether an array is alive only as an
    output a compiled plan keeps to write its next call's output into), or None where no
    compiled plan has run in this process (nothing is kept; the module is not imported)."""
    workspace = sys.modules.get("backplan.codegen.run.workspace")
    return None if workspace is None else workspace.kept_only_for_reuse
