"""Tensor's methods are declared once, as real methods (tracer/tensor_methods.py) that call the
op functions: each takes the parameters of the op it calls, with the same names and defaults,
so a changed op signature fails here instead of drifting from the method type checkers see."""

import inspect

import numpy as np
import pytest

import backplan as bp
from backplan.tracer import conv, ops
from backplan.tracer.tensor_methods import TensorMethods

OPERATOR_OPS = {
    "__add__": "add", "__sub__": "sub", "__mul__": "mul", "__truediv__": "div",
    "__pow__": "pow", "__matmul__": "matmul", "__lt__": "less", "__le__": "less_equal",
    "__gt__": "greater", "__ge__": "greater_equal", "__eq__": "equal", "__ne__": "not_equal",
    "__neg__": "neg", "__abs__": "abs",
}  # fmt: skip
NOT_OPS = {"view", "graph", "detach", "T", "mT", "__getitem__", "__dlpack__", "__dlpack_device__"}


def _methods():
    for name, member in vars(TensorMethods).items():
        if callable(member) and (not name.startswith("__") or name in OPERATOR_OPS):
            yield name, member


def _params(fn, skip: int):
    return [
        (p.name, p.kind, p.default) for p in list(inspect.signature(fn).parameters.values())[skip:]
    ]


@pytest.mark.parametrize("name,method", [m for m in _methods() if m[0] not in NOT_OPS])
def test_a_method_takes_the_parameters_of_its_op(name, method):
    op = getattr(ops, OPERATOR_OPS.get(name, name), None) or getattr(conv, name)
    method_params = [(n, k, d) for n, k, d in _params(method, 1)]
    op_params = _params(op, 1)
    if name in OPERATOR_OPS:  # x + y: the operand's name is the method's own
        method_params = [(k, d) for _, k, d in method_params]
        op_params = [(k, d) for _, k, d in op_params]
    assert method_params == op_params


def test_methods_and_reflected_operators_compute_what_the_ops_do():
    x = bp.tensor(np.arange(6, dtype=np.float32).reshape(2, 3) + 1)
    cases = [
        (x.sum(1, True), bp.sum(x, 1, keepdims=True)),
        (x.logsumexp(axis=0), bp.logsumexp(x, 0)),
        (2.0 - x, bp.sub(2.0, x)),
        (2.0**x, bp.pow(2.0, x)),
        (x.T, bp.transpose(x)),
        (x.take(bp.tensor(np.array([1, 0])), axis=1), bp.take(x, bp.tensor(np.array([1, 0])), 1)),
        (x.argmax(), bp.argmax(x)),
        (x.argmin(0, True), bp.argmin(x, 0, keepdims=True)),
    ]
    for got, want in cases:
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    assert {x: 1}[x] == 1  # __eq__ is an op, yet tensors stay hashable by identity


def test_argmax_takes_numpys_and_pytorchs_spellings():
    """logits.argmax(dim=-1) (PyTorch), x.argmax(axis=1) (NumPy, JAX) and bp.argmax(x, dim=1)
    all mean the index of the first maximum, so each runs as written."""
    data = np.array([[1.0, 5.0, 5.0], [7.0, -1.0, 0.0]], np.float32)
    x = bp.tensor(data)
    np.testing.assert_array_equal(x.argmax(dim=-1).numpy(), data.argmax(-1))
    np.testing.assert_array_equal(
        x.argmax(axis=1, keepdims=True).numpy(), data.argmax(1, keepdims=True)
    )
    np.testing.assert_array_equal(
        x.argmin(dim=0, keepdim=True).numpy(), data.argmin(0, keepdims=True)
    )
    np.testing.assert_array_equal(bp.argmax(x, dim=1).numpy(), data.argmax(1))
    with pytest.raises(TypeError, match="both dim= and axis="):
        x.argmax(dim=0, axis=0)
    with pytest.raises(
        bp.ShapeError, match=r"argmax: axis 2 is out of range .* at test_tensor_methods.py:\d+"
    ):
        x.argmax(2)
