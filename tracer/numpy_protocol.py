"""NumPy's protocols on Tensor: `np.exp(t)`, `np.sum(t, axis=0)`, `ndarray + t` run backplan's
own ops, so the result is a Tensor that keeps the graph (and traces inside @compile). A NumPy
function backplan has no op for raises TypeError naming the way out, instead of quietly
returning an ndarray cut from the graph. `np.asarray(t)` still gives the values (a read-only
view) on purpose: asking for an array is explicit."""

from __future__ import annotations

import inspect

import numpy as np

from . import ops
from .tensor import Tensor

UFUNCS = {
    np.add: ops.add,
    np.subtract: ops.sub,
    np.multiply: ops.mul,
    np.true_divide: ops.div,
    np.power: ops.pow,
    np.matmul: ops.matmul,
    np.maximum: ops.maximum,
    np.minimum: ops.minimum,
    np.less: ops.less,
    np.less_equal: ops.less_equal,
    np.greater: ops.greater,
    np.greater_equal: ops.greater_equal,
    np.equal: ops.equal,
    np.not_equal: ops.not_equal,
    np.negative: ops.neg,
    np.absolute: ops.abs,
    np.sign: ops.sign,
    np.exp: ops.exp,
    np.log: ops.log,
    np.tanh: ops.tanh,
    np.sqrt: ops.sqrt,
    np.sin: ops.sin,
    np.cos: ops.cos,
}

# NumPy function -> (backplan op taking NumPy's argument names, the names it understands)
FUNCTIONS = {
    np.sum: (lambda a, axis=None, keepdims=False: ops.sum(a, axis, keepdims), "bp.sum"),
    np.mean: (lambda a, axis=None, keepdims=False: ops.mean(a, axis, keepdims), "bp.mean"),
    np.max: (lambda a, axis=None, keepdims=False: ops.max(a, axis, keepdims), "bp.max"),
    np.min: (lambda a, axis=None, keepdims=False: ops.min(a, axis, keepdims), "bp.min"),
    np.var: (lambda a, axis=None, keepdims=False, ddof=0: _var(a, axis, keepdims, ddof), "bp.var"),
    np.cumsum: (lambda a, axis=None: ops.cumsum(a, axis), "bp.cumsum"),
    np.reshape: (lambda a, shape: ops.reshape(a, shape), "bp.reshape"),
    np.transpose: (lambda a, axes=None: ops.transpose(a, *([] if axes is None else [axes])), ""),
    np.swapaxes: (lambda a, axis1, axis2: ops.swapaxes(a, axis1, axis2), "bp.swapaxes"),
    np.squeeze: (lambda a, axis=None: ops.squeeze(a, axis), "bp.squeeze"),
    np.expand_dims: (lambda a, axis: ops.expand_dims(a, axis), "bp.expand_dims"),
    np.broadcast_to: (lambda array, shape: ops.broadcast_to(array, shape), "bp.broadcast_to"),
    np.concatenate: (lambda arrays, axis=0: ops.concatenate(arrays, axis), "bp.concatenate"),
    np.stack: (lambda arrays, axis=0: ops.stack(arrays, axis), "bp.stack"),
    np.where: (lambda condition, x=None, y=None: _where(condition, x, y), "bp.where"),
    np.take: (lambda a, indices, axis=None: _take(a, indices, axis), "bp.take"),
    np.shape: (lambda a: a.shape, ""),
    np.ndim: (lambda a: a.ndim, ""),
    np.size: (lambda a, axis=None: a.size if axis is None else a.shape[axis], ""),
}
for _alias, _name in ((np.amax, np.max), (np.amin, np.min)):
    FUNCTIONS[_alias] = FUNCTIONS[_name]

# Functions whose result carries no gradient (booleans, indices): computed by NumPy on the
# values, so they work on concrete tensors and raise TracingError inside @compile.
VALUE_FUNCTIONS = {np.allclose, np.isclose, np.array_equal, np.array_equiv, np.argmax, np.argmin}

_UNSET = (None, np._NoValue)


def _var(a, axis, keepdims, ddof):
    if ddof != 0:
        raise TypeError(f"np.var(..., ddof={ddof}) on a tensor: bp.var computes ddof=0 only")
    return ops.var(a, axis, keepdims)


def _where(condition, x, y):
    if x is None or y is None:
        raise TypeError(
            "np.where(condition) with one argument has a data-dependent shape; backplan plans "
            "are static: use bp.where(condition, x, y)"
        )
    return ops.where(condition, x, y)


def _take(a, indices, axis):
    return ops.take(ops.flatten(a) if axis is None else a, indices, 0 if axis is None else axis)


def array_ufunc(self, ufunc, method, *inputs, **kwargs):
    fn = UFUNCS.get(ufunc)
    name = f"np.{ufunc.__name__}"
    if method != "__call__":
        raise TypeError(
            f"{name}.{method} on a backplan tensor is not supported; use the backplan op "
            f"instead (np.add.reduce -> bp.sum), or call it on t.numpy() to leave the graph"
        )
    if fn is None:
        raise TypeError(_unsupported(name, ufunc.__name__))
    for key, value in kwargs.items():
        if key == "out" and any(v is not None for v in value):
            raise TypeError(
                f"{name}(..., out=...) on a backplan tensor: tensors are immutable, so results "
                "cannot be written into an existing array; use the return value"
            )
        if key != "out" and value is not None:
            raise TypeError(
                f"{name}(..., {key}=...) is not supported on backplan tensors; call "
                f"bp.{fn.__name__} and cast with .astype() if needed"
            )
    return fn(*inputs)


def array_function(self, func, types, args, kwargs):
    name = f"np.{func.__name__}"
    if func in VALUE_FUNCTIONS:
        plain = [a.numpy() if isinstance(a, Tensor) else a for a in args]
        return func(*plain, **kwargs)
    entry = FUNCTIONS.get(func)
    if entry is None:
        raise TypeError(_unsupported(name, func.__name__))
    adapter, bp_name = entry
    bound = inspect.signature(func).bind(*args, **kwargs).arguments
    accepted = inspect.signature(adapter).parameters
    call = {}
    for key, value in bound.items():
        if key in accepted:
            call[key] = value
        elif value is not None and value is not np._NoValue and (key, value) != ("order", "C"):
            shown = bp_name or "the backplan op"
            raise TypeError(
                f"{name}(..., {key}={value!r}) is not supported on backplan tensors; {shown} "
                f"takes {', '.join(accepted)}"
            )
    call = {k: (False if v is np._NoValue else v) for k, v in call.items()}
    return adapter(**call)


def _unsupported(name: str, short: str) -> str:
    from backplan.tracer import ops as ops_module

    if hasattr(ops_module, short) and not short.startswith("_"):
        return f"{name} on a backplan tensor is not wired to NumPy; call bp.{short} instead"
    return (
        f"{name} has no backplan op, so it cannot run on a tensor without leaving the graph; "
        f"call {name}(t.numpy()) to compute with NumPy outside the graph (no gradient flows "
        "back), or build it from backplan ops"
    )


def install(tensor_cls) -> None:
    tensor_cls.__array_ufunc__ = array_ufunc
    tensor_cls.__array_function__ = array_function
