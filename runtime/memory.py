"""Accounting of the bytes all live graphs hold in saved buffers."""

import threading
import weakref

# id(region) -> weak reference, no callback: a WeakSet's add and its removal callback cost
# every recorded call ~0.8 us of Python. Dead entries wait until the table has doubled since
# the last sweep (or a region reusing the id replaces them); live_regions skips them.
_live_regions: dict = {}
_lock = threading.Lock()  # one thread changes the table at a time; readers copy it under it
_sweep_at = 1024


def track(region) -> None:
    global _sweep_at
    with _lock:
        _live_regions[id(region)] = weakref.ref(region)
        if len(_live_regions) >= _sweep_at:
            for key, ref in list(_live_regions.items()):
                if ref() is None:
                    del _live_regions[key]
            _sweep_at = max(1024, 2 * len(_live_regions))


def live_regions() -> list:
    with _lock:
        refs = list(_live_regions.values())
    return [region for region in (ref() for ref in refs) if region is not None]


def live_saved_bytes(yours: bool = False) -> int:
    """Bytes of the saved buffers every graph still alive has allocated, each array counted
    once however many regions save it; your own arrays (passed in, leaf tensors) that graphs
    keep references to are not among them: `live_saved_bytes(yours=True)` gives those. Drops
    to 0 once each graph has run backward (without retain_graph) or has been released.

    >>> import backplan as bp
    >>> bp.live_saved_bytes() >= 0
    True
    """
    from .saved_once import held_totals

    totals = held_totals(live_regions())
    return totals.yours if yours else totals.allocated
