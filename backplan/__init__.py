"""backplan: compile numerical model functions into static forward and backward plans whose
saved buffers, lifetimes and frees are known before anything runs.

>>> import backplan as bp
>>> x = bp.tensor([1.0, -2.0], requires_grad=True)
>>> y = bp.tanh(x).sum()
>>> [b.name for b in y.grad_fn.saved_buffers] if y.grad_fn else []
[]
"""

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
from backplan.tracer.artifact_format import ExportError
from backplan.tracer.artifact_load import load
from backplan.tracer.explain import explain
from backplan.tracer.export import export
from backplan.tracer.ops import (
    abs,
    add,
    as_tensor,
    astype,
    broadcast_to,
    concatenate,
    cross_entropy,
    div,
    embedding,
    equal,
    erf,
    exp,
    expand_dims,
    flatten,
    full,
    gelu,
    greater,
    greater_equal,
    layer_norm,
    less,
    less_equal,
    log,
    log_softmax,
    logsumexp,
    matmul,
    max,
    maximum,
    mean,
    min,
    minimum,
    mse_loss,
    mul,
    neg,
    not_equal,
    one_hot,
    ones,
    ones_like,
    permute,
    pow,
    relu,
    reshape,
    sigmoid,
    sign,
    softmax,
    sqrt,
    squeeze,
    stack,
    stop_gradient,
    sub,
    sum,
    swapaxes,
    take,
    tanh,
    tensor,
    transpose,
    unsqueeze,
    var,
    where,
    zeros,
    zeros_like,
)
from backplan.tracer.pytree import tree_map

__version__ = "0.1.0"


def zero_grad(tree) -> None:
    """Clear .grad of every tensor in a pytree (a model's parameters, say)."""
    tree_map(lambda t: t.zero_grad() if isinstance(t, Tensor) else None, tree)


__all__ = [name for name in dir() if not name.startswith("_")]
