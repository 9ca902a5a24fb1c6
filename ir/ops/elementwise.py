"""Elementwise ops. Operands broadcast like NumPy and share one dtype (the tracer promotes)."""

import math

import numpy as np

from ..registry import AttrSpec, OpDef, register
from .common import elementwise_type, float_only, numeric_only

GELU_K = math.sqrt(2.0 / math.pi)
GELU_C = 0.044715


def _binary(
    name, ref, scalar, vjp=None, out_dtype=None, differentiable=True, floats=False, doc="",
    cost="cheap",
):  # fmt: skip
    def infer(types, attrs):
        if floats:
            float_only(types, name)
        elif out_dtype is None:
            numeric_only(types, name)
        return elementwise_type(types, name, out_dtype)

    register(
        OpDef(
            name, (2,), infer, ref, "elementwise", vjp, differentiable, doc=doc, scalar=scalar,
            cost=cost,
        )
    )  # fmt: skip


def _unary(
    name, ref, scalar, vjp=None, floats=True, differentiable=True, attrs=None, doc="",
    cost="costly",
):  # fmt: skip
    def infer(types, attrs):
        (float_only if floats else numeric_only)(types, name)
        return types[0]

    register(
        OpDef(
            name, (1,), infer, ref, "elementwise", vjp, differentiable, attrs or {}, doc,
            scalar=scalar, cost=cost,
        )
    )  # fmt: skip


# ---- derivative rules -------------------------------------------------------------------------


def _add_vjp(ctx, g):
    b = ctx.b
    return [b.sum_to(g, ctx.in_type(0).shape), b.sum_to(g, ctx.in_type(1).shape)]


def _sub_vjp(ctx, g):
    b = ctx.b
    gy = b.neg(g) if ctx.needs[1] else None
    return [b.sum_to(g, ctx.in_type(0).shape), gy and b.sum_to(gy, ctx.in_type(1).shape)]


def _mul_vjp(ctx, g):
    b = ctx.b
    gx = b.sum_to(b.mul(g, ctx.input(1)), ctx.in_type(0).shape) if ctx.needs[0] else None
    gy = b.sum_to(b.mul(g, ctx.input(0)), ctx.in_type(1).shape) if ctx.needs[1] else None
    return [gx, gy]


def _div_vjp(ctx, g):
    b = ctx.b
    gx = gy = None
    if ctx.needs[0]:
        gx = b.sum_to(b.div(g, ctx.input(1)), ctx.in_type(0).shape)
    if ctx.needs[1]:
        gy = b.neg(b.div(b.mul(g, ctx.output()), ctx.input(1)))
        gy = b.sum_to(gy, ctx.in_type(1).shape)
    return [gx, gy]


def _pow_vjp(ctx, g):
    b = ctx.b
    dtype = ctx.out_type.dtype
    gx = gy = None
    if ctx.needs[0]:
        x, y = ctx.input(0), ctx.input(1)
        ym1 = b.sub(y, b.scalar(1, dtype))
        gx = b.sum_to(b.mul(g, b.mul(y, b.pow(x, ym1))), ctx.in_type(0).shape)
    if ctx.needs[1]:
        x = ctx.input(0)
        zero = b.scalar(0, dtype)
        safe_log = b.where(
            b.gt(x, zero), b.log(b.where(b.gt(x, zero), x, b.scalar(1, dtype))), zero
        )
        gy = b.sum_to(b.mul(g, b.mul(ctx.output(), safe_log)), ctx.in_type(1).shape)
    return [gx, gy]


def _select_vjp(greater):
    """maximum (greater) or minimum: the gradient goes to the operand selected, and ties split
    it evenly, as torch.maximum and jax.numpy.maximum do (a tie is a kink: either one-sided
    derivative is as right, the mean is the symmetric choice). Where x is NaN neither side
    gets it, as in JAX."""

    def vjp(ctx, g):
        b = ctx.b
        x, y = ctx.input(0), ctx.input(1)
        zero = b.scalar(0, g.dtype)
        share = b.where(b.eq(x, y), b.mul(g, b.scalar(0.5, g.dtype)), zero)
        gx = gy = None
        if ctx.needs[0]:
            wins = b.gt(x, y) if greater else b.lt(x, y)
            gx = b.sum_to(b.where(wins, g, share), ctx.in_type(0).shape)
        if ctx.needs[1]:
            wins = b.lt(x, y) if greater else b.gt(x, y)
            gy = b.sum_to(b.where(wins, g, share), ctx.in_type(1).shape)
        return [gx, gy]

    return vjp


_binary("add", np.add, "({0} + {1})", _add_vjp, doc="x + y")
_binary("sub", np.subtract, "({0} - {1})", _sub_vjp, doc="x - y")
_binary(
    "mul",
    np.multiply,
    "({0} * {1})",
    _mul_vjp,
    doc="x * y; saves only the operand the other side needs",
)
_binary("div", np.true_divide, "({0} / {1})", _div_vjp, floats=True, doc="x / y")
_binary("pow", np.power, "({0} ** {1})", _pow_vjp, doc="x ** y", cost="costly")
_binary(
    "maximum",
    np.maximum,
    "({0} if ({0} >= {1} or {0} != {0}) else {1})",
    _select_vjp(True),
    doc="ties split the gradient evenly between x and y (as torch and JAX)",
)
_binary(
    "minimum",
    np.minimum,
    "({0} if ({0} <= {1} or {0} != {0}) else {1})",
    _select_vjp(False),
    doc="ties split the gradient evenly between x and y (as torch and JAX)",
)
for _name, _ref, _symbol in [
    ("lt", np.less, "<"),
    ("le", np.less_equal, "<="),
    ("gt", np.greater, ">"),
    ("ge", np.greater_equal, ">="),
    ("eq", np.equal, "=="),
    ("ne", np.not_equal, "!="),
]:
    _binary(
        _name, _ref, f"({{0}} {_symbol} {{1}})", out_dtype="bool", differentiable=False,
        doc="comparison, bool result",
    )  # fmt: skip


def _neg_vjp(ctx, g):
    return [ctx.b.neg(g)]


def _exp_vjp(ctx, g):
    return [ctx.b.mul(g, ctx.output())]


def _log_vjp(ctx, g):
    return [ctx.b.div(g, ctx.input(0))]


def _tanh_vjp(ctx, g):
    b, y = ctx.b, ctx.output()
    return [b.mul(g, b.sub(b.scalar(1, g.dtype), b.mul(y, y)))]


def _sin_vjp(ctx, g):
    return [ctx.b.mul(g, ctx.b.cos(ctx.input(0)))]


def _cos_vjp(ctx, g):
    return [ctx.b.neg(ctx.b.mul(g, ctx.b.sin(ctx.input(0))))]


def _sigmoid_vjp(ctx, g):
    b, y = ctx.b, ctx.output()
    return [b.mul(g, b.mul(y, b.sub(b.scalar(1, g.dtype), y)))]


def _relu_vjp(ctx, g):
    b = ctx.b
    zero = b.scalar(0, g.dtype)
    return [b.where(b.gt(ctx.output(), zero), g, zero)]


def _sqrt_vjp(ctx, g):
    b = ctx.b
    return [b.div(b.mul(g, b.scalar(0.5, g.dtype)), ctx.output())]


def _abs_vjp(ctx, g):
    return [ctx.b.mul(g, ctx.b.sign(ctx.input(0)))]


def _erf_vjp(ctx, g):
    b, x = ctx.b, ctx.input(0)
    dens = b.exp(b.neg(b.mul(x, x)))
    return [b.mul(g, b.mul(dens, b.scalar(2.0 / math.sqrt(math.pi), g.dtype)))]


def _gelu_vjp(ctx, g):
    """Derivative of gelu, rebuilt from x so only x is saved."""
    b, x, dt = ctx.b, ctx.input(0), g.dtype
    half, one = b.scalar(0.5, dt), b.scalar(1, dt)
    if ctx.attrs["approximate"] == "tanh":
        x2 = b.mul(x, x)
        inner = b.mul(b.scalar(GELU_K, dt), b.add(x, b.mul(b.scalar(GELU_C, dt), b.mul(x2, x))))
        t = b.tanh(inner)
        dinner = b.mul(b.scalar(GELU_K, dt), b.add(one, b.mul(b.scalar(3 * GELU_C, dt), x2)))
        left = b.mul(half, b.add(one, t))
        right = b.mul(b.mul(half, x), b.mul(b.sub(one, b.mul(t, t)), dinner))
        return [b.mul(g, b.add(left, right))]
    cdf = b.mul(half, b.add(one, b.erf(b.mul(x, b.scalar(1 / math.sqrt(2), dt)))))
    pdf = b.mul(
        b.exp(b.mul(b.mul(x, x), b.scalar(-0.5, dt))), b.scalar(1 / math.sqrt(2 * math.pi), dt)
    )
    return [b.mul(g, b.add(cdf, b.mul(x, pdf)))]


def _gelu_ref(x, approximate):
    dt = x.dtype.type
    if approximate == "tanh":
        inner = dt(GELU_K) * (x + dt(GELU_C) * x * x * x)
        return dt(0.5) * x * (dt(1) + np.tanh(inner))
    return dt(0.5) * x * (dt(1) + _erf_ref(x * dt(1 / math.sqrt(2))))


def _relu_ref(x):
    return np.maximum(x, x.dtype.type(0))


def _sigmoid_ref(x):
    from scipy import special  # imported on first use: it costs 0.1 s at startup

    return special.expit(x)


_unary("neg", np.negative, "(-{0})", _neg_vjp, cost="cheap", floats=False, doc="-x")
_unary("exp", np.exp, "exp_{dtype}({0})", _exp_vjp, doc="saves its output")
_unary("log", np.log, "log_{dtype}({0})", _log_vjp, doc="saves its input")
_unary("tanh", np.tanh, "tanh_{dtype}({0})", _tanh_vjp, doc="saves its output")
_unary("sin", np.sin, "math.sin({0})", _sin_vjp, doc="saves its input")
_unary("cos", np.cos, "math.cos({0})", _cos_vjp, doc="saves its input")
_unary("sigmoid", _sigmoid_ref, "sigmoid_{dtype}({0})", _sigmoid_vjp, doc="saves its output")
_unary(
    "relu",
    _relu_ref,
    "({0} if not {0} <= 0 else {zero})",
    _relu_vjp,
    floats=False,
    cost="cheap",
    doc="saves its output",
)
_unary("sqrt", np.sqrt, "math.sqrt({0})", _sqrt_vjp, doc="saves its output")
_unary("abs", np.abs, "abs({0})", _abs_vjp, floats=False, cost="cheap", doc="saves its input")
_unary(
    "sign",
    np.sign,
    "(1 if {0} > 0 else (-1 if {0} < 0 else {0}))",
    floats=False,
    cost="cheap",
    differentiable=False,
    doc="no gradient",
)


def _erf_ref(x):
    from scipy import special

    return special.erf(x)


_unary("erf", _erf_ref, "erf_{dtype}({0})", _erf_vjp, doc="saves its input")
_unary(
    "gelu",
    _gelu_ref,
    "gelu_{approximate}_{dtype}({0})",
    _gelu_vjp,
    attrs={"approximate": AttrSpec("str", "none", ("none", "tanh"), required=False)},
    doc="saves its input; the derivative is rebuilt from it",
)


def _where_infer(types, attrs):
    from ..errors import DtypeError
    from ..shapes import broadcast_shapes
    from ..types import TensorType

    cond, x, y = types
    if cond.dtype != "bool":
        raise DtypeError(f"condition must be bool, got {cond.dtype}")
    if x.dtype != y.dtype:
        raise DtypeError(f"branches have different dtypes {x.dtype} and {y.dtype}")
    return TensorType(x.dtype, broadcast_shapes(cond.shape, x.shape, y.shape))


def _where_vjp(ctx, g):
    b = ctx.b
    cond = ctx.input(0)
    zero = b.scalar(0, g.dtype)
    gx = b.sum_to(b.where(cond, g, zero), ctx.in_type(1).shape) if ctx.needs[1] else None
    gy = b.sum_to(b.where(cond, zero, g), ctx.in_type(2).shape) if ctx.needs[2] else None
    return [None, gx, gy]


register(
    OpDef(
        "where",
        (3,),
        _where_infer,
        np.where,
        "elementwise",
        _where_vjp,
        doc="where(cond, x, y); saves cond",
        scalar="({1} if {0} else {2})",
        cost="cheap",
    )
)
