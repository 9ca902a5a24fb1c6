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


def live_saved_bytes() -> int:
    """Bytes held in saved buffers by every graph still alive. Drops to 0 once each graph has
    run backward (without retain_graph) or has been released.

    >>> import backplan as bp
    >>> bp.live_saved_bytes() >= 0
    True
    """
    return sum(region.saved_bytes for region in live_regions())
