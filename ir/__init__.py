"""backplan.ir: graphs, the op registry, passes and the reference interpreter. Imports nothing
from the other layers."""

from . import ops  # registers every op in the registry before anything can look one up
from .errors import (
    BackplanError,
    DtypeError,
    ExecutionError,
    ParseError,
    ShapeError,
    VerifyError,
)
from .graph import Graph, Value
from .registry import OpDef, all_ops, get_op
from .types import TensorType

__all__ = [
    "BackplanError",
    "DtypeError",
    "ExecutionError",
    "ParseError",
    "ShapeError",
    "VerifyError",
    "Graph",
    "Value",
    "OpDef",
    "all_ops",
    "get_op",
    "TensorType",
]
