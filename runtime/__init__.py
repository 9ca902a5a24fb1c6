"""backplan.runtime: regions, the backward engine, grad mode and memory accounting."""

from .engine import backward
from .errors import BackwardError, GraphFreedError
from .grad_mode import enable_grad, is_grad_enabled, no_grad
from .memory import live_saved_bytes
from .program import RegionProgram
from .region import Edge, Region, SavedBuffer

__all__ = [
    "backward",
    "BackwardError",
    "GraphFreedError",
    "enable_grad",
    "is_grad_enabled",
    "no_grad",
    "live_saved_bytes",
    "RegionProgram",
    "Edge",
    "Region",
    "SavedBuffer",
]
