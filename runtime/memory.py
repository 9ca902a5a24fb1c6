"""Accounting of the bytes all live graphs hold in saved buffers."""

import threading
import weakref

_live_regions: "weakref.WeakSet" = weakref.WeakSet()
_lock = threading.Lock()  # a WeakSet must not grow while another thread lists it


def track(region) -> None:
    with _lock:
        _live_regions.add(region)


def live_regions() -> list:
    with _lock:
        return list(_live_regions)


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
