"""One table of op samples that drives every op-level test.

Each sample names a registry op, how to make its inputs (from a seed, well conditioned: log on
positive values, no ties for max/maximum, a positive base for pow), its attributes, a NumPy
oracle written without the registry's reference code, the public call that reaches the op (where
there is one) and the forward values its derivative rule must save. test_registry.py walks the
registry and fails when an op has no sample here, so a new op cannot skip its checks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from scipy import special

import backplan as bp

DTYPE = "<dtype>"  # attribute placeholder: the sample's float dtype
OTHER_FLOAT = "<other float>"  # attribute placeholder: the float dtype that is not the sample's
FLOATS = ("f32", "f64")
FLOAT_KINDS = ("normal", "positive", "distinct", "away_from_zero", "grid")
NP_DTYPES = {"f32": np.float32, "f64": np.float64, "i64": np.int64, "bool": np.bool_}


def IN(i: int) -> tuple[str, int]:  # noqa: N802 - reads like the saved slot it names
    """A saved slot that is region input i."""
    return ("input", i)


OUT = ("output", 0)  # the saved slot that is the op's own output


@dataclass(frozen=True)
class Arg:
    """How one input is made. Float kinds take the sample's dtype; an i64 sample makes them
    small integers with the same property (positive, distinct, ...)."""

    shape: tuple[int, ...]
    kind: str = "normal"
    high: int = 0  # labels: class count; indices: axis size (negative indices included)
    phase: int = 0  # distinct: 0 and 1 make two arrays that never share a value

    @property
    def is_float(self) -> bool:
        return self.kind in FLOAT_KINDS

    def make(self, rng: np.random.Generator, dtype: str) -> np.ndarray:
        n = math.prod(self.shape)
        if self.kind == "labels":
            return rng.integers(0, self.high, size=self.shape).astype(np.int64)
        if self.kind == "indices":
            return rng.integers(-self.high, self.high, size=self.shape).astype(np.int64)
        if self.kind == "mask":
            return rng.random(self.shape) < 0.5
        if dtype == "i64":
            return _integers(rng, self.kind, n, self.phase).reshape(self.shape)
        return _floats(rng, self.kind, n, self.phase).reshape(self.shape).astype(NP_DTYPES[dtype])


def _floats(rng, kind, n, phase):
    if kind == "normal":
        return rng.standard_normal(n)
    if kind == "positive":
        return rng.uniform(0.5, 2.0, n)
    if kind == "distinct":  # at least 0.15 apart, within one array and across phases
        grid = (rng.permutation(n) * 2 + phase) * 0.25 - n * 0.25
        return grid + rng.uniform(-0.05, 0.05, n)
    if kind == "away_from_zero":
        return rng.choice([-1.0, 1.0], n) * rng.uniform(0.2, 2.0, n)
    if kind == "grid":  # few distinct values, so comparisons meet equality often
        return rng.integers(-1, 3, n).astype(np.float64)
    raise ValueError(kind)


def _integers(rng, kind, n, phase):
    if kind == "positive":
        return rng.integers(1, 4, n)
    if kind == "distinct":
        return rng.permutation(n) * 2 + phase - n
    if kind == "away_from_zero":
        return rng.choice([-1, 1], n) * rng.integers(1, 5, n)
    return rng.integers(-4, 5, n)


@dataclass(frozen=True)
class OpSample:
    """One call of a registry op with its expected results."""

    op: str
    args: tuple[Arg, ...]
    oracle: Callable
    attrs: dict = field(default_factory=dict)
    dtypes: tuple[str, ...] = FLOATS
    public: Callable | None = None  # public(*tensors, **attrs): the user-facing call
    saves: frozenset | None = None  # saved slots when every float input needs a gradient
    constant: Arg | None = None  # const only: the array stored as graph constant "k0"
    label: str = ""
    seed: int = 0

    @property
    def id(self) -> str:
        return f"{self.op}-{self.label}" if self.label else self.op

    def resolved_attrs(self, dtype: str) -> dict:
        other = "f64" if dtype == "f32" else "f32"
        swap = {DTYPE: dtype, OTHER_FLOAT: other}
        return {k: swap.get(v, v) if isinstance(v, str) else v for k, v in self.attrs.items()}

    def inputs(self, dtype: str) -> list[np.ndarray]:
        rng = np.random.default_rng(1000 + self.seed)
        return [arg.make(rng, dtype) for arg in self.args]

    def constants(self, dtype: str) -> dict[str, np.ndarray]:
        if self.constant is None:
            return {}
        return {"k0": self.constant.make(np.random.default_rng(2000 + self.seed), dtype)}

    def float_inputs(self, dtype: str) -> list[int]:
        """Inputs a gradient can flow into: float inputs of a float sample."""
        if dtype not in FLOATS:
            return []
        return [i for i, arg in enumerate(self.args) if arg.is_float]


# ---- oracles, written from the textbook formulas ----------------------------------------------


def np_softmax(x, axis):
    e = np.exp(x)
    return e / e.sum(axis=axis, keepdims=True)


def np_log_softmax(x, axis):
    return x - np.log(np.exp(x).sum(axis=axis, keepdims=True))


def np_logsumexp(x, axes, keepdims):
    return np.log(np.exp(x).sum(axis=axes, keepdims=keepdims))


def np_cross_entropy(logits, labels, reduction):
    logp = np_log_softmax(logits, -1)
    rows = np.indices(labels.shape)
    losses = -logp[(*rows, labels)]
    if reduction == "none":
        return losses
    return losses.sum() if reduction == "sum" else losses.mean()


def np_cumsum(x, axis, reverse):
    """NumPy's cumsum, from the end when reverse."""
    if reverse:
        return np.flip(np.cumsum(np.flip(x, axis), axis), axis)
    return np.cumsum(x, axis)


def np_layer_norm(x, *affine, eps):
    y = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps)
    return y * affine[0] + affine[1] if affine else y


def np_gelu(x, approximate):
    if approximate == "tanh":
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    return x * 0.5 * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def np_slice(x, starts, stops, steps):
    index = [np.arange(a, b, c) for a, b, c in zip(starts, stops, steps, strict=True)]
    return x[np.ix_(*index)]


def np_pad_slice(g, shape, starts, stops, steps):
    out = np.zeros(shape, dtype=g.dtype)
    index = [np.arange(a, b, c) for a, b, c in zip(starts, stops, steps, strict=True)]
    out[np.ix_(*index)] = g
    return out


def np_take_grad(g, idx, axis, size):
    out = np.zeros(g.shape[:axis] + (size,) + g.shape[axis + idx.ndim :], dtype=g.dtype)
    for position in np.ndindex(*idx.shape):
        target = (slice(None),) * axis + (idx[position] % size,)
        source = (slice(None),) * axis + position
        out[target] += g[source]
    return out


def np_one_hot(labels, depth, dtype):
    return np.eye(depth, dtype=NP_DTYPES[dtype])[labels]


def np_sigmoid(x):
    return 1 / (1 + np.exp(-x))


def np_relu(x):
    return np.where(x > 0, x, 0 * x)


def np_reduce(fn):
    def oracle(x, axes, keepdims):
        return fn(x, axis=axes, keepdims=keepdims)

    return oracle


MASK32 = 0xFFFFFFFF


def py_threefry(key, counter):
    """Threefry-2x32-20 on Python ints, written from Random123's specification."""
    rotations = ((13, 15, 26, 6), (17, 29, 16, 24))
    ks = [key[0], key[1], key[0] ^ key[1] ^ 0x1BD11BDA]
    x = [(counter[0] + ks[0]) & MASK32, (counter[1] + ks[1]) & MASK32]
    for block in range(5):
        for r in rotations[block % 2]:
            x[0] = (x[0] + x[1]) & MASK32
            x[1] = (((x[1] << r) | (x[1] >> (32 - r))) & MASK32) ^ x[0]
        x[0] = (x[0] + ks[(block + 1) % 3]) & MASK32
        x[1] = (x[1] + ks[(block + 2) % 3] + block + 1) & MASK32
    return x


def py_words(key, count):
    return [py_threefry([int(k) for k in key], [j >> 32, j & MASK32]) for j in range(count)]


def np_random_uniform(key, shape, dtype):
    size = math.prod(shape)
    if dtype == "f32":
        words = [w for pair in py_words(key, (size + 1) // 2) for w in pair][:size]
        values = [(w >> 8) / 2**24 for w in words]
    else:
        values = [((a >> 5) * 2**26 + (b >> 6)) / 2**53 for a, b in py_words(key, size)]
    return np.array(values, NP_DTYPES[dtype]).reshape(shape)


def np_random_normal(key, shape, dtype):
    size, values = math.prod(shape), []
    for a, b in py_words(key, (size + 1) // 2):
        radius = math.sqrt(-2 * math.log((a + 1) / 2**32))
        values += [
            radius * math.cos(2 * math.pi * b / 2**32),
            radius * math.sin(2 * math.pi * b / 2**32),
        ]
    return np.array(values[:size], NP_DTYPES[dtype]).reshape(shape)


def np_random_split(key, count):
    return np.array([py_threefry([int(k) for k in key], [MASK32, c]) for c in range(count)])


def _conv_windows(xp, out_hw, kernel_hw, stride, dilation):
    """(r, q, window (N, C, kH, kW)) of a padded input for each output position."""
    (kh, kw), (sh, sw), (dh, dw) = kernel_hw, stride, dilation
    for r in range(out_hw[0]):
        for q in range(out_hw[1]):
            rows = slice(r * sh, r * sh + dh * (kh - 1) + 1, dh)
            cols = slice(q * sw, q * sw + dw * (kw - 1) + 1, dw)
            yield r, q, rows, cols


def _conv_geometry(x_shape, w_shape, stride, padding, dilation):
    return tuple(
        (x_shape[2 + a] + 2 * padding[a] - dilation[a] * (w_shape[2 + a] - 1) - 1) // stride[a] + 1
        for a in range(2)
    )


def np_conv2d(x, w, stride, padding, dilation, groups):
    out_hw = _conv_geometry(x.shape, w.shape, stride, padding, dilation)
    (ph, pw), cg, og = padding, w.shape[1], w.shape[0] // groups
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    out = np.zeros((x.shape[0], w.shape[0]) + out_hw, x.dtype)
    for r, q, rows, cols in _conv_windows(xp, out_hw, w.shape[2:], stride, dilation):
        for g in range(groups):
            window = xp[:, g * cg : (g + 1) * cg, rows, cols]
            out[:, g * og : (g + 1) * og, r, q] = np.einsum(
                "nckl,ockl->no", window, w[g * og : (g + 1) * og]
            )
    return out


def np_conv2d_input_grad(g_out, w, input_shape, stride, padding, dilation, groups):
    (ph, pw), cg, og = padding, w.shape[1], w.shape[0] // groups
    n, c, h, wd = input_shape
    dxp = np.zeros((n, c, h + 2 * ph, wd + 2 * pw), g_out.dtype)
    for r, q, rows, cols in _conv_windows(dxp, g_out.shape[2:], w.shape[2:], stride, dilation):
        for g in range(groups):
            dxp[:, g * cg : (g + 1) * cg, rows, cols] += np.einsum(
                "no,ockl->nckl", g_out[:, g * og : (g + 1) * og, r, q], w[g * og : (g + 1) * og]
            )
    return dxp[:, :, ph : ph + h, pw : pw + wd]


def np_conv2d_weight_grad(x, g_out, weight_shape, stride, padding, dilation, groups):
    (ph, pw), cg, og = padding, weight_shape[1], weight_shape[0] // groups
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    dw = np.zeros(weight_shape, x.dtype)
    for r, q, rows, cols in _conv_windows(xp, g_out.shape[2:], weight_shape[2:], stride, dilation):
        for g in range(groups):
            dw[g * og : (g + 1) * og] += np.einsum(
                "no,nckl->ockl",
                g_out[:, g * og : (g + 1) * og, r, q],
                xp[:, g * cg : (g + 1) * cg, rows, cols],
            )
    return dw


def _attention_weights(q, k, scale, causal):
    """softmax over keys, row by row, from the textbook formula exp(s_j) / sum_j exp(s_j)."""
    t, n = q.shape[-2], k.shape[-2]
    scores = scale * np.einsum("...td,...sd->...ts", q, k)
    allowed = np.arange(n)[None, :] <= np.arange(t)[:, None] if causal else np.ones((t, n), bool)
    shifted = np.where(
        allowed, scores - scores.max(axis=-1, keepdims=True, initial=-np.inf), -np.inf
    )
    weights = np.exp(shifted)
    return weights / weights.sum(axis=-1, keepdims=True)


def _heads_first(layout, *arrays):
    """layout "bthd" arrays (B, T, H, D) as (B, H, T, D), or back (the swap is an involution)."""
    return [np.swapaxes(x, 1, 2) if layout == "bthd" else x for x in arrays]


def np_attention(q, k, v, scale, causal, layout="bhtd"):
    q, k, v = _heads_first(layout, q, k, v)
    out = np.einsum("...ts,...se->...te", _attention_weights(q, k, scale, causal), v)
    return _heads_first(layout, out)[0]


def np_attention_grad(q, k, v, g, scale, causal, layout="bhtd"):
    """d/dq, d/dk, d/dv of sum(attention(q, k, v) * g), flattened and concatenated."""
    q, k, v, g = _heads_first(layout, q, k, v, g)
    w = _attention_weights(q, k, scale, causal)
    dv = np.einsum("...ts,...te->...se", w, g)
    dw = np.einsum("...te,...se->...ts", g, v)
    ds = w * (dw - np.einsum("...ts,...ts->...t", w, dw)[..., None]) * scale
    dq = np.einsum("...ts,...sd->...td", ds, k)
    dk = np.einsum("...ts,...td->...sd", ds, q)
    return np.concatenate([x.ravel() for x in _heads_first(layout, dq, dk, dv)])


def public_attention(q, k, v, scale, causal):
    return bp.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


# ---- the table --------------------------------------------------------------------------------

A = Arg
MATRIX, ROW = A((3, 4)), A((4,))
CONV_ODD = {"stride": (2, 1), "padding": (1, 0), "dilation": (1, 2), "groups": 1}
CONV_GROUPS = {"stride": (1, 1), "padding": (1, 1), "dilation": (1, 1), "groups": 2}


def public_sum(x, axes, keepdims):
    return bp.sum(x, axes, keepdims)


def public_max(x, axes, keepdims):
    return bp.max(x, axes, keepdims)


def public_reshape(x, shape):
    return bp.reshape(x, shape)


def public_transpose(x, perm):
    return bp.transpose(x, perm)


def S(op, args, oracle, **kw) -> OpSample:  # noqa: N802 - short constructor for the table
    return OpSample(op, tuple(args), oracle, **kw)


def _binary(op, oracle, public, saves, a=MATRIX, b=ROW, **kw):
    return S(op, [a, b], oracle, public=public, saves=frozenset(saves), **kw)


def _unary(op, oracle, public, saves, kind="normal", shape=(3, 4), **kw):
    return S(
        op,
        [A(shape, kind)],
        oracle,
        public=public,
        saves=None if saves is None else frozenset(saves),
        **kw,
    )


SAMPLES: list[OpSample] = [
    # sources
    S(
        "full",
        [],
        lambda value, shape, dtype: np.full(shape, value, NP_DTYPES[dtype]),
        attrs={"value": 1.5, "shape": (2, 3), "dtype": DTYPE},
        public=lambda value, shape, dtype: bp.full(shape, value, dtype),
    ),
    S(
        "full",
        [],
        lambda value, shape, dtype: np.full(shape, value, NP_DTYPES[dtype]),
        attrs={"value": -3, "shape": (4,), "dtype": "i64"},
        dtypes=("i64",),
        label="int",
        public=lambda value, shape, dtype: bp.full(shape, value, dtype),
    ),
    S(
        "full",
        [],
        lambda value, shape, dtype: np.full(shape, value, NP_DTYPES[dtype]),
        attrs={"value": -math.inf, "shape": (), "dtype": DTYPE},
        label="neg_inf",
    ),
    S(
        "const",
        [],
        lambda array, **attrs: array,
        attrs={"name": "k0", "shape": (2, 3), "dtype": DTYPE},
        constant=A((2, 3)),
    ),
    # elementwise binary
    _binary("add", np.add, bp.add, []),
    _binary("add", np.add, bp.add, [], dtypes=("i64",), label="int"),
    _binary("sub", np.subtract, bp.sub, [], a=A((2, 3, 4)), b=A((3, 1))),
    _binary("mul", np.multiply, bp.mul, [IN(0), IN(1)], b=A((3, 4)), seed=1),
    _binary("mul", np.multiply, bp.mul, [IN(0), IN(1)], a=A((3, 1)), b=A((1, 4)), label="outer"),
    _binary("mul", np.multiply, bp.mul, [], dtypes=("i64",), label="int"),
    _binary("div", np.divide, bp.div, [IN(1), OUT], b=A((4,), "positive")),
    _binary("pow", np.power, bp.pow, [IN(0), IN(1), OUT], a=A((3, 4), "positive"), b=A((3, 4))),
    _binary(
        "maximum",
        np.maximum,
        bp.maximum,
        [IN(0), IN(1)],
        a=A((3, 4), "distinct"),
        b=A((3, 4), "distinct", phase=1),
    ),
    _binary(
        "maximum",
        np.maximum,
        bp.maximum,
        [],
        a=A((3, 4), "distinct"),
        b=A((4,), "distinct", phase=1),
        dtypes=("i64",),
        label="int",
    ),
    _binary(
        "minimum",
        np.minimum,
        bp.minimum,
        [IN(0), IN(1)],
        a=A((3, 4), "distinct"),
        b=A((4,), "distinct", phase=1),
    ),
    _binary("lt", np.less, bp.less, [], a=A((3, 4), "grid"), b=A((4,), "grid")),
    _binary("le", np.less_equal, bp.less_equal, [], a=A((3, 4), "grid"), b=A((4,), "grid")),
    _binary("gt", np.greater, bp.greater, [], a=A((3, 4), "grid"), b=A((4,), "grid")),
    _binary("ge", np.greater_equal, bp.greater_equal, [], a=A((3, 4), "grid"), b=A((4,), "grid")),
    _binary("eq", np.equal, bp.equal, [], a=A((3, 4), "grid"), b=A((4,), "grid")),
    _binary("ne", np.not_equal, bp.not_equal, [], a=A((3, 4), "grid"), b=A((4,), "grid")),
    _binary(
        "lt",
        np.less,
        bp.less,
        [],
        a=A((3, 4), "grid"),
        b=A((4,), "grid"),
        dtypes=("i64",),
        label="int",
    ),
    # elementwise unary
    _unary("neg", np.negative, bp.neg, []),
    _unary("neg", np.negative, bp.neg, [], dtypes=("i64",), label="int"),
    _unary("exp", np.exp, bp.exp, [OUT]),
    _unary("log", np.log, bp.log, [IN(0)], kind="positive"),
    _unary("tanh", np.tanh, bp.tanh, [OUT]),
    _unary("sigmoid", np_sigmoid, bp.sigmoid, [OUT]),
    _unary("relu", np_relu, bp.relu, [OUT], kind="away_from_zero"),
    _unary("relu", np_relu, bp.relu, [], kind="away_from_zero", dtypes=("i64",), label="int"),
    _unary("sqrt", np.sqrt, bp.sqrt, [OUT], kind="positive"),
    _unary("abs", np.abs, bp.abs, [IN(0)], kind="away_from_zero"),
    _unary("abs", np.abs, bp.abs, [], dtypes=("i64",), label="int"),
    _unary("sign", np.sign, bp.sign, None, kind="grid"),
    _unary("sign", np.sign, bp.sign, None, dtypes=("i64",), label="int"),
    _unary("erf", special.erf, bp.erf, [IN(0)]),
    _unary("sin", np.sin, bp.sin, [IN(0)]),
    _unary("cos", np.cos, bp.cos, [IN(0)]),
    _unary("gelu", np_gelu, bp.gelu, [IN(0)], attrs={"approximate": "none"}),
    _unary("gelu", np_gelu, bp.gelu, [IN(0)], attrs={"approximate": "tanh"}, label="tanh"),
    _unary("stop_gradient", lambda x: x, bp.stop_gradient, None),
    S(
        "where",
        [A((3, 4), "mask"), A((3, 4)), A((4,))],
        np.where,
        public=bp.where,
        saves=frozenset([IN(0)]),
    ),
    S(
        "where",
        [A((3, 1), "mask"), A((4,)), A((3, 4))],
        np.where,
        public=bp.where,
        saves=frozenset([IN(0)]),
        dtypes=("i64",),
        label="int",
    ),
    # linear algebra
    _binary("matmul", np.matmul, bp.matmul, [IN(0), IN(1)], a=A((3, 4)), b=A((4, 5))),
    _binary(
        "matmul",
        np.matmul,
        bp.matmul,
        [IN(0), IN(1)],
        a=A((2, 1, 3, 4)),
        b=A((3, 4, 2)),
        label="batched",
    ),
    _binary(
        "matmul", np.matmul, bp.matmul, [], a=A((2, 3)), b=A((3, 2)), dtypes=("i64",), label="int"
    ),
    # reductions
    _unary("sum", np_reduce(np.sum), public_sum, [], attrs={"axes": (1,), "keepdims": False}),
    _unary(
        "sum",
        np_reduce(np.sum),
        public_sum,
        [],
        shape=(2, 3, 4),
        attrs={"axes": (0, 2), "keepdims": True},
        label="keepdims",
    ),
    _unary(
        "sum",
        np_reduce(np.sum),
        public_sum,
        [],
        attrs={"axes": (0, 1), "keepdims": False},
        label="all",
    ),
    _unary(
        "sum",
        np_reduce(np.sum),
        public_sum,
        [],
        attrs={"axes": (0,), "keepdims": False},
        dtypes=("i64",),
        label="int",
    ),
    _unary(
        "max",
        np_reduce(np.max),
        public_max,
        [IN(0), OUT],
        kind="distinct",
        attrs={"axes": (1,), "keepdims": False},
    ),
    _unary(
        "max",
        np_reduce(np.max),
        public_max,
        [IN(0), OUT],
        kind="distinct",
        shape=(2, 3, 4),
        attrs={"axes": (0, 2), "keepdims": True},
        label="keepdims",
    ),
    _unary(
        "max",
        np_reduce(np.max),
        public_max,
        [],
        kind="distinct",
        attrs={"axes": (1,), "keepdims": False},
        dtypes=("i64",),
        label="int",
    ),
    _unary(
        "logsumexp",
        np_logsumexp,
        lambda x, axes, keepdims: bp.logsumexp(x, axes, keepdims),
        [IN(0), OUT],
        attrs={"axes": (1,), "keepdims": False},
    ),
    _unary(
        "logsumexp",
        np_logsumexp,
        lambda x, axes, keepdims: bp.logsumexp(x, axes, keepdims),
        [IN(0), OUT],
        shape=(2, 3, 4),
        attrs={"axes": (0, 2), "keepdims": True},
        label="keepdims",
    ),
    # composites with their own entries
    _unary("softmax", np_softmax, bp.softmax, [OUT], shape=(3, 5), attrs={"axis": 1}),
    _unary(
        "softmax", np_softmax, bp.softmax, [OUT], shape=(4, 3, 2), attrs={"axis": 0}, label="axis0"
    ),
    _unary("log_softmax", np_log_softmax, bp.log_softmax, [OUT], shape=(3, 5), attrs={"axis": 1}),
    S(
        "cross_entropy",
        [A((4, 5)), A((4,), "labels", high=5)],
        np_cross_entropy,
        attrs={"reduction": "mean"},
        public=bp.cross_entropy,
        saves=frozenset([IN(0), IN(1)]),
    ),
    S(
        "cross_entropy",
        [A((2, 3, 5)), A((2, 3), "labels", high=5)],
        np_cross_entropy,
        attrs={"reduction": "sum"},
        public=bp.cross_entropy,
        saves=frozenset([IN(0), IN(1)]),
        label="sum",
    ),
    S(
        "cross_entropy",
        [A((4, 5)), A((4,), "labels", high=5)],
        np_cross_entropy,
        attrs={"reduction": "none"},
        public=bp.cross_entropy,
        saves=frozenset([IN(0), IN(1)]),
        label="none",
    ),
    S(
        "layer_norm",
        [A((3, 6))],
        np_layer_norm,
        attrs={"eps": 1e-5},
        public=lambda x, eps: bp.layer_norm(x, eps=eps),
        saves=frozenset([IN(0)]),
    ),
    S(
        "layer_norm",
        [A((2, 3, 6)), A((6,)), A((6,))],
        np_layer_norm,
        attrs={"eps": 1e-3},
        public=lambda x, w, b, eps: bp.layer_norm(x, w, b, eps=eps),
        saves=frozenset([IN(0), IN(1)]),
        label="affine",
    ),
    # data movement
    _unary(
        "reshape", lambda x, shape: x.reshape(shape), public_reshape, [], attrs={"shape": (2, 6)}
    ),
    _unary(
        "reshape",
        lambda x, shape: x.reshape(shape),
        public_reshape,
        [],
        shape=(2, 3, 4),
        attrs={"shape": (4, 1, 6)},
        label="3d",
    ),
    _unary(
        "transpose",
        lambda x, perm: x.transpose(perm),
        public_transpose,
        [],
        shape=(2, 3, 4),
        attrs={"perm": (2, 0, 1)},
    ),
    _unary(
        "transpose",
        lambda x, perm: x.transpose(perm),
        public_transpose,
        [],
        shape=(2, 3),
        attrs={"perm": (1, 0)},
        dtypes=("i64",),
        label="int",
    ),
    _unary(
        "broadcast_to",
        lambda x, shape: np.broadcast_to(x, shape),
        bp.broadcast_to,
        [],
        shape=(3, 1),
        attrs={"shape": (2, 3, 4)},
    ),
    _unary(
        "slice",
        np_slice,
        lambda x, **a: x[1:4, ::2],
        [],
        shape=(5, 6),
        attrs={"starts": (1, 0), "stops": (4, 6), "steps": (1, 2)},
    ),
    _unary(
        "slice",
        np_slice,
        lambda x, **a: x[::-1],
        [],
        shape=(5,),
        attrs={"starts": (4,), "stops": (-1,), "steps": (-1,)},
        label="reversed",
    ),
    _unary(
        "slice",
        np_slice,
        lambda x, **a: x[:, 4:0:-2],
        [],
        shape=(3, 6),
        attrs={"starts": (0, 4), "stops": (3, 0), "steps": (1, -2)},
        label="negative_step",
    ),
    _unary(
        "pad_slice",
        np_pad_slice,
        None,
        [],
        shape=(3, 3),
        attrs={"shape": (5, 6), "starts": (1, 0), "stops": (4, 6), "steps": (1, 2)},
    ),
    _unary(
        "pad_slice",
        np_pad_slice,
        None,
        [],
        shape=(2,),
        attrs={"shape": (5,), "starts": (4,), "stops": (-1,), "steps": (-3,)},
        label="negative_step",
    ),
    S(
        "concatenate",
        [A((2, 3)), A((2, 1)), A((2, 2))],
        lambda *xs, axis: np.concatenate(xs, axis),
        attrs={"axis": 1},
        public=lambda *xs, axis: bp.concatenate(xs, axis),
        saves=frozenset(),
    ),
    S(
        "concatenate",
        [A((2, 3))],
        lambda *xs, axis: np.concatenate(xs, axis),
        attrs={"axis": 0},
        public=lambda *xs, axis: bp.concatenate(xs, axis),
        saves=frozenset(),
        label="single",
    ),
    S(
        "concatenate",
        [A((1, 2)), A((3, 2))],
        lambda *xs, axis: np.concatenate(xs, axis),
        attrs={"axis": 0},
        public=lambda *xs, axis: bp.concatenate(xs, axis),
        dtypes=("i64",),
        label="int",
    ),
    S(
        "take",
        [A((5, 3)), A((6,), "indices", high=5)],
        lambda x, i, axis: x[i],
        attrs={"axis": 0},
        public=lambda x, i, axis: x[i],
        saves=frozenset([IN(1)]),
    ),
    S(
        "take",
        [A((2, 5, 3)), A((2, 2), "indices", high=5)],
        lambda x, i, axis: x[:, i % 5],
        attrs={"axis": 1},
        public=bp.take,
        saves=frozenset([IN(1)]),
        label="axis1",
    ),
    S(
        "take_grad",
        [A((6, 3)), A((6,), "indices", high=5)],
        np_take_grad,
        attrs={"axis": 0, "size": 5},
        saves=frozenset([IN(1)]),
    ),
    S(
        "take_grad",
        [A((2, 2, 2, 3)), A((2, 2), "indices", high=4)],
        np_take_grad,
        attrs={"axis": 1, "size": 4},
        saves=frozenset([IN(1)]),
        label="axis1",
    ),
    # casts and encodings
    S(
        "one_hot",
        [A((5,), "labels", high=4)],
        np_one_hot,
        attrs={"depth": 4, "dtype": DTYPE},
        public=lambda labels, depth, dtype: bp.one_hot(labels, depth, dtype),
    ),
    _unary(
        "astype",
        lambda x, dtype: x.astype(NP_DTYPES[dtype]),
        bp.astype,
        [],
        attrs={"dtype": OTHER_FLOAT},
    ),
    _unary(
        "astype",
        lambda x, dtype: x.astype(NP_DTYPES[dtype]),
        bp.astype,
        None,
        kind="away_from_zero",
        attrs={"dtype": "i64"},
        label="to_int",
    ),
    _unary(
        "astype",
        lambda x, dtype: x.astype(NP_DTYPES[dtype]),
        bp.astype,
        None,
        attrs={"dtype": "f32"},
        dtypes=("i64",),
        label="from_int",
    ),
    S(
        "astype",
        [A((2, 3), "mask")],
        lambda x, dtype: x.astype(NP_DTYPES[dtype]),
        attrs={"dtype": DTYPE},
        public=bp.astype,
        label="from_bool",
    ),
    # random draws (keys are i64[2] of 32-bit words)
    S(
        "random_uniform",
        [A((2,), "labels", high=2**32)],
        np_random_uniform,
        attrs={"shape": (3, 5), "dtype": DTYPE},
        public=lambda key, shape, dtype: bp.random.uniform(key, shape, dtype),
    ),
    S(
        "random_normal",
        [A((2,), "labels", high=2**32)],
        np_random_normal,
        attrs={"shape": (7,), "dtype": DTYPE},
        public=lambda key, shape, dtype: bp.random.normal(key, shape, dtype),
        seed=1,
    ),
    S(
        "random_split",
        [A((2,), "labels", high=2**32)],
        np_random_split,
        attrs={"count": 3},
        public=lambda key, count: bp.stack(bp.random.split(key, count)),
    ),
    # convolution (NCHW)
    S(
        "conv2d",
        [A((2, 3, 7, 6)), A((4, 3, 3, 2))],
        np_conv2d,
        attrs=CONV_ODD,
        public=lambda x, w, **a: bp.conv2d(x, w, **a),
        saves=frozenset([IN(0), IN(1)]),
    ),
    S(
        "conv2d",
        [A((1, 4, 5, 5)), A((6, 2, 3, 3))],
        np_conv2d,
        attrs=CONV_GROUPS,
        public=lambda x, w, **a: bp.conv2d(x, w, **a),
        saves=frozenset([IN(0), IN(1)]),
        label="groups",
    ),
    S(
        "conv2d_input_grad",
        [A((2, 4, 4, 4)), A((4, 3, 3, 2))],
        np_conv2d_input_grad,
        attrs={**CONV_ODD, "input_shape": (2, 3, 7, 6)},
        saves=frozenset([IN(0), IN(1)]),
    ),
    S(
        "conv2d_input_grad",
        [A((1, 6, 5, 5)), A((6, 2, 3, 3))],
        np_conv2d_input_grad,
        attrs={**CONV_GROUPS, "input_shape": (1, 4, 5, 5)},
        saves=frozenset([IN(0), IN(1)]),
        label="groups",
    ),
    S(
        "conv2d_weight_grad",
        [A((2, 3, 7, 6)), A((2, 4, 4, 4))],
        np_conv2d_weight_grad,
        attrs={**CONV_ODD, "weight_shape": (4, 3, 3, 2)},
        saves=frozenset([IN(0), IN(1)]),
    ),
    S(
        "conv2d_weight_grad",
        [A((1, 4, 5, 5)), A((1, 6, 5, 5))],
        np_conv2d_weight_grad,
        attrs={**CONV_GROUPS, "weight_shape": (6, 2, 3, 3)},
        saves=frozenset([IN(0), IN(1)]),
        label="groups",
    ),
    # fused attention (q, k, v share their leading axes)
    S(
        "attention",
        [A((2, 3, 5, 4)), A((2, 3, 6, 4)), A((2, 3, 6, 3))],
        np_attention,
        attrs={"scale": 0.5, "causal": False},
        public=public_attention,
        saves=frozenset([IN(0), IN(1), IN(2)]),
    ),
    S(
        "attention",
        [A((7, 3)), A((4, 3)), A((4, 5))],
        np_attention,
        attrs={"scale": 0.7, "causal": True},
        public=public_attention,
        saves=frozenset([IN(0), IN(1), IN(2)]),
        label="causal",
    ),
    S(  # (batch, length, heads, features): written where a head transpose reads the output
        "attention",
        [A((2, 5, 3, 4)), A((2, 6, 3, 4)), A((2, 6, 3, 3))],
        np_attention,
        attrs={"scale": 0.5, "causal": True, "layout": "bthd"},
        saves=frozenset([IN(0), IN(1), IN(2)]),
        label="bthd",
    ),
    S(
        "attention_grad",
        [A((2, 5, 4)), A((2, 6, 4)), A((2, 6, 3)), A((2, 5, 3))],
        np_attention_grad,
        attrs={"scale": 0.5, "causal": False},
        saves=frozenset([IN(0), IN(1), IN(2), IN(3)]),
    ),
    S(
        "attention_grad",
        [A((1, 2, 6, 3)), A((1, 2, 6, 3)), A((1, 2, 6, 2)), A((1, 2, 6, 2))],
        np_attention_grad,
        attrs={"scale": 0.6, "causal": True},
        saves=frozenset([IN(0), IN(1), IN(2), IN(3)]),
        label="causal",
    ),
    S(
        "attention_grad",
        [A((1, 6, 2, 3)), A((1, 7, 2, 3)), A((1, 7, 2, 2)), A((1, 6, 2, 2))],
        np_attention_grad,
        attrs={"scale": 0.6, "causal": False, "layout": "bthd"},
        saves=frozenset([IN(0), IN(1), IN(2), IN(3)]),
        label="bthd",
    ),
    # arg-extremes
    _unary(
        "argmax",
        lambda x, axis, keepdims: np.argmax(x, axis, keepdims=keepdims),
        lambda x, axis, keepdims: bp.argmax(x, axis, keepdims),
        None,
        kind="distinct",
        shape=(3, 4, 5),
        attrs={"axis": 1, "keepdims": False},
    ),
    _unary(
        "argmax",
        lambda x, axis, keepdims: np.argmax(x, axis, keepdims=keepdims),
        lambda x, axis, keepdims: bp.argmax(x, axis, keepdims),
        None,
        shape=(3, 4),
        attrs={"axis": 0, "keepdims": True},
        dtypes=("i64",),
        label="int",
    ),
    _unary(
        "argmin",
        lambda x, axis, keepdims: np.argmin(x, axis, keepdims=keepdims),
        lambda x, axis, keepdims: bp.argmin(x, axis, keepdims),
        None,
        kind="grid",
        shape=(4, 6),
        attrs={"axis": 1, "keepdims": True},
    ),
    # scans
    _unary(
        "cumsum",
        lambda x, axis, reverse: np_cumsum(x, axis, reverse),
        lambda x, axis, reverse: bp.cumsum(x, axis, reverse=reverse),
        [],
        shape=(3, 5, 2),
        attrs={"axis": 1, "reverse": False},
    ),
    _unary(
        "cumsum",
        lambda x, axis, reverse: np_cumsum(x, axis, reverse),
        lambda x, axis, reverse: x.cumsum(axis, reverse),
        [],
        shape=(7, 3),
        attrs={"axis": 0, "reverse": True},
        dtypes=FLOATS + ("i64",),
        label="reverse",
    ),
]
