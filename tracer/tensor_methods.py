"""Tensor's operators and op methods, declared once: each is a real method with its signature,
calling the op function of the same meaning (tracer/ops.py and friends). Tensor inherits them.

The op functions import Tensor, so this module cannot import them: tracer/methods.py binds them
here (`bind`) when backplan.tracer is imported, before any tensor exists.
tests/test_tensor_methods.py checks that every method takes the parameters of the op it calls;
a method takes PyTorch's keywords (dim=, keepdim=) where its op does, with the same decorator.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from .torch_names import (
    extremum_values_and_indices,
    refuse_torch_dim,
    torch_keywords,
    variance_correction,
)

if TYPE_CHECKING:
    from .graph_view import GraphReport
    from .tensor import Axis, DTypeLike, Tensor, TensorLike

_ops: Any = None  # backplan.tracer.ops, bound by bind()
_more: Any = None  # getitem, graph, detach, view, dlpack, dlpack_device, argmax, argmin: bind()


def bind(ops, **more) -> None:
    """Give the methods the functions they call (tracer/methods.py, once, at import)."""
    global _ops, _more
    _ops, _more = ops, SimpleNamespace(**more)


class TensorMethods:
    """What `x + y`, `x.sum()`, `x.T` and the other methods of Tensor call."""

    __slots__ = ()

    # ---- arithmetic and comparison operators ----------------------------------------------
    def __add__(self, other: TensorLike) -> Tensor:
        return _ops.add(self, other)

    def __radd__(self, other: TensorLike) -> Tensor:
        return _ops.add(other, self)

    def __sub__(self, other: TensorLike) -> Tensor:
        return _ops.sub(self, other)

    def __rsub__(self, other: TensorLike) -> Tensor:
        return _ops.sub(other, self)

    def __mul__(self, other: TensorLike) -> Tensor:
        return _ops.mul(self, other)

    def __rmul__(self, other: TensorLike) -> Tensor:
        return _ops.mul(other, self)

    def __truediv__(self, other: TensorLike) -> Tensor:
        return _ops.div(self, other)

    def __rtruediv__(self, other: TensorLike) -> Tensor:
        return _ops.div(other, self)

    def __pow__(self, other: TensorLike) -> Tensor:
        return _ops.pow(self, other)

    def __rpow__(self, other: TensorLike) -> Tensor:
        return _ops.pow(other, self)

    def __matmul__(self, other: TensorLike) -> Tensor:
        return _ops.matmul(self, other)

    def __rmatmul__(self, other: TensorLike) -> Tensor:
        return _ops.matmul(other, self)

    def __lt__(self, other: TensorLike) -> Tensor:
        return _ops.less(self, other)

    def __le__(self, other: TensorLike) -> Tensor:
        return _ops.less_equal(self, other)

    def __gt__(self, other: TensorLike) -> Tensor:
        return _ops.greater(self, other)

    def __ge__(self, other: TensorLike) -> Tensor:
        return _ops.greater_equal(self, other)

    def __eq__(self, other: object) -> Tensor:  # type: ignore[override]
        return _ops.equal(self, other)

    def __ne__(self, other: object) -> Tensor:  # type: ignore[override]
        return _ops.not_equal(self, other)

    __hash__ = object.__hash__  # defining __eq__ would otherwise make tensors unhashable

    def __neg__(self) -> Tensor:
        return _ops.neg(self)

    def __abs__(self) -> Tensor:
        return _ops.abs(self)

    def __getitem__(self, key: Any) -> Tensor:
        return _more.getitem(self, key)

    # ---- reductions -----------------------------------------------------------------------
    @torch_keywords
    def sum(self, axis: Axis = None, keepdims: bool = False) -> Tensor:
        return _ops.sum(self, axis, keepdims)

    @torch_keywords
    def mean(self, axis: Axis = None, keepdims: bool = False) -> Tensor:
        return _ops.mean(self, axis, keepdims)

    @refuse_torch_dim(variance_correction)
    def var(self, axis: Axis = None, keepdims: bool = False) -> Tensor:
        return _ops.var(self, axis, keepdims)

    @refuse_torch_dim(extremum_values_and_indices)
    def max(self, axis: Axis = None, keepdims: bool = False) -> Tensor:
        return _ops.max(self, axis, keepdims)

    @refuse_torch_dim(extremum_values_and_indices)
    def min(self, axis: Axis = None, keepdims: bool = False) -> Tensor:
        return _ops.min(self, axis, keepdims)

    @torch_keywords
    def argmax(self, axis: Axis = None, keepdims: bool = False) -> Tensor:
        return _more.argmax(self, axis, keepdims)

    @torch_keywords
    def argmin(self, axis: Axis = None, keepdims: bool = False) -> Tensor:
        return _more.argmin(self, axis, keepdims)

    @torch_keywords
    def logsumexp(self, axis: Axis = None, keepdims: bool = False) -> Tensor:
        return _ops.logsumexp(self, axis, keepdims)

    @torch_keywords
    def cumsum(self, axis: int | None = None, reverse: bool = False) -> Tensor:
        return _ops.cumsum(self, axis, reverse)

    # ---- shapes ---------------------------------------------------------------------------
    def reshape(self, *shape: int | Sequence[int]) -> Tensor:
        return _ops.reshape(self, *shape)

    def view(self, *shape: int | Sequence[int]) -> Tensor:
        return _more.view(self, *shape)

    def transpose(self, *axes: int | Sequence[int]) -> Tensor:
        return _ops.transpose(self, *axes)

    def permute(self, *axes: int | Sequence[int]) -> Tensor:
        return _ops.permute(self, *axes)

    def swapaxes(self, a: int, b: int) -> Tensor:
        return _ops.swapaxes(self, a, b)

    def broadcast_to(self, shape: Sequence[int]) -> Tensor:
        return _ops.broadcast_to(self, shape)

    @torch_keywords
    def expand_dims(self, axis: int) -> Tensor:
        return _ops.expand_dims(self, axis)

    @torch_keywords
    def unsqueeze(self, axis: int) -> Tensor:
        return _ops.unsqueeze(self, axis)

    @torch_keywords
    def squeeze(self, axis: Axis = None) -> Tensor:
        return _ops.squeeze(self, axis)

    @torch_keywords
    def flatten(self, start_axis: int = 0) -> Tensor:
        return _ops.flatten(self, start_axis)

    @property
    def T(self) -> Tensor:
        return _ops.transpose(self)

    @property
    def mT(self) -> Tensor:
        return _ops.swapaxes(self, -1, -2)

    # ---- elementwise and row ops ----------------------------------------------------------
    def astype(self, dtype: DTypeLike) -> Tensor:
        return _ops.astype(self, dtype)

    def exp(self) -> Tensor:
        return _ops.exp(self)

    def log(self) -> Tensor:
        return _ops.log(self)

    def tanh(self) -> Tensor:
        return _ops.tanh(self)

    def sigmoid(self) -> Tensor:
        return _ops.sigmoid(self)

    def relu(self) -> Tensor:
        return _ops.relu(self)

    def sqrt(self) -> Tensor:
        return _ops.sqrt(self)

    def abs(self) -> Tensor:
        return _ops.abs(self)

    @torch_keywords
    def softmax(self, axis: int = -1) -> Tensor:
        return _ops.softmax(self, axis)

    @torch_keywords
    def log_softmax(self, axis: int = -1) -> Tensor:
        return _ops.log_softmax(self, axis)

    def take(self, indices: TensorLike, axis: int = 0) -> Tensor:
        return _ops.take(self, indices, axis)

    def matmul(self, b: TensorLike) -> Tensor:
        return _ops.matmul(self, b)

    def pow(self, b: TensorLike) -> Tensor:
        return _ops.pow(self, b)

    # ---- graph, interchange ---------------------------------------------------------------
    def graph(self) -> GraphReport:
        """The whole graph behind this tensor: see bp.explain_graph."""
        return _more.graph(self)

    def detach(self) -> Tensor:
        """Same values, cut from the graph: no gradient flows back through the result."""
        return _more.detach(self)

    def __dlpack__(self, **kwargs: Any) -> Any:
        return _more.dlpack(self, **kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return _more.dlpack_device(self)
