"""Operators and methods of Tensor, as thin calls into the op functions. tensor.py defines the
class without them (the ops need the class); tracer/__init__.py installs them once, before any
tensor exists."""

from collections.abc import Sequence

from . import dlpack, indexing, inplace, numpy_protocol, ops
from .graph_view import explain_graph
from .source import loc_text, user_frame_loc
from .tensor import Tensor
from .torch_names import TENSOR_SPELLINGS, spelling_only


def _detach(self: Tensor) -> Tensor:
    """Same values, cut from the graph: no gradient flows back through the result."""
    self._check_live()
    if self._data is None:
        return ops.stop_gradient(self)
    return Tensor._from_array(self._data)


def _view(self: Tensor, *shape) -> Tensor:
    """PyTorch's x.view(*shape): a reshape (tensors are immutable, so a view and a copy cannot
    be told apart). x.view(dtype) reinterprets bits in PyTorch, which backplan does not do."""
    if (
        len(shape) == 1
        and not isinstance(shape[0], int | Sequence)
        and not hasattr(shape[0], "__index__")
    ):
        raise TypeError(
            f"view({shape[0]!r}) at {loc_text(user_frame_loc())}: reinterpreting the bits as "
            "another dtype is not supported; x.astype(dtype) converts the values"
        )
    return ops.reshape(self, *shape)


def _swap(fn):
    return lambda a, b: fn(b, a)


_OPERATORS = {
    "__add__": ops.add,
    "__radd__": _swap(ops.add),
    "__sub__": ops.sub,
    "__rsub__": _swap(ops.sub),
    "__mul__": ops.mul,
    "__rmul__": _swap(ops.mul),
    "__truediv__": ops.div,
    "__rtruediv__": _swap(ops.div),
    "__pow__": ops.pow,
    "__rpow__": _swap(ops.pow),
    "__matmul__": ops.matmul,
    "__rmatmul__": _swap(ops.matmul),
    "__lt__": ops.less,
    "__le__": ops.less_equal,
    "__gt__": ops.greater,
    "__ge__": ops.greater_equal,
    "__eq__": ops.equal,
    "__ne__": ops.not_equal,
    "__neg__": ops.neg,
    "__abs__": ops.abs,
    "__getitem__": indexing.getitem,
}

_METHODS = {
    "sum": ops.sum,
    "mean": ops.mean,
    "var": ops.var,
    "max": ops.max,
    "min": ops.min,
    "reshape": ops.reshape,
    "view": _view,
    "transpose": ops.transpose,
    "permute": ops.permute,
    "swapaxes": ops.swapaxes,
    "broadcast_to": ops.broadcast_to,
    "expand_dims": ops.expand_dims,
    "unsqueeze": ops.unsqueeze,
    "squeeze": ops.squeeze,
    "flatten": ops.flatten,
    "astype": ops.astype,
    "exp": ops.exp,
    "log": ops.log,
    "tanh": ops.tanh,
    "sigmoid": ops.sigmoid,
    "relu": ops.relu,
    "sqrt": ops.sqrt,
    "abs": ops.abs,
    "softmax": ops.softmax,
    "log_softmax": ops.log_softmax,
    "logsumexp": ops.logsumexp,
    "take": ops.take,
    "matmul": ops.matmul,
    "pow": ops.pow,
    "graph": explain_graph,
    "detach": _detach,
}


def install_tensor_methods() -> None:
    for name, fn in {**_OPERATORS, **_METHODS}.items():
        setattr(Tensor, name, fn)
    Tensor.T = property(lambda self: ops.transpose(self))
    Tensor.mT = property(lambda self: ops.swapaxes(self, -1, -2))
    numpy_protocol.install(Tensor)
    dlpack.install(Tensor)
    inplace.install(Tensor)
    for name in TENSOR_SPELLINGS.keys() - vars(Tensor).keys():
        setattr(Tensor, name, spelling_only(name))
