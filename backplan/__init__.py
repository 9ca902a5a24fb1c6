"""backplan: compile numerical model functions into static forward and backward plans whose
saved buffers, lifetimes and frees are known before anything runs.

>>> import backplan as bp
>>> x = bp.tensor([1.0, -2.0], requires_grad=True)
>>> y = bp.tanh(x).sum()
>>> [b.name for b in y.grad_fn.saved_buffers] if y.grad_fn else []
[]
"""

from backplan.artifacts.export import export
from backplan.artifacts.format import ExportError
from backplan.artifacts.load import load
from backplan.ir.errors import (
    BackplanError,
    DtypeError,
    ExecutionError,
    ParseError,
    ShapeError,
    VerifyError,
)
from backplan.runtime import (
    BackwardError,
    GraphFreedError,
    enable_grad,
    is_grad_enabled,
    live_saved_bytes,
    no_grad,
)
from backplan.tracer import Tensor, TracingError, compile, grad, value_and_grad
from backplan.tracer.explain import explain
from backplan.tracer.graph_view import explain_graph
from backplan.tracer.ops import *  # noqa: F403  (every op users call; tracer/ops.py lists them)
from backplan.tracer.ops import __all__ as _ops_all
from backplan.tracer.pytree import tree_map

__version__ = "0.1.0"


def zero_grad(tree) -> None:
    """Clear .grad of every tensor in a pytree (a model's parameters, say)."""
    tree_map(lambda t: t.zero_grad() if isinstance(t, Tensor) else None, tree)


__all__ = [
    *_ops_all,
    "BackplanError",
    "BackwardError",
    "DtypeError",
    "ExecutionError",
    "ExportError",
    "GraphFreedError",
    "ParseError",
    "ShapeError",
    "Tensor",
    "TracingError",
    "VerifyError",
    "compile",
    "enable_grad",
    "explain",
    "explain_graph",
    "export",
    "grad",
    "is_grad_enabled",
    "live_saved_bytes",
    "load",
    "no_grad",
    "tree_map",
    "value_and_grad",
    "zero_grad",
]
