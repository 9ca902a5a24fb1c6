"""Random small programs (a few ops chained: elementwise with broadcasting, reductions, reshape,
transpose, slicing, integer indexing, concatenation, matmul, softmax) run three ways: eager,
@bp.compile and plain NumPy. Values must agree, and gradients (eager, compiled, bp.grad) must
agree with float64 central finite differences."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from scipy import special

import backplan as bp

MAX_EXAMPLES = int(os.environ.get("BACKPLAN_HYPOTHESIS_EXAMPLES", "40"))
FD_EPS = 1e-6

# ---- two backends with the same names: NumPy and backplan -------------------------------------


def _np_softmax(x, axis):
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


def _np_cross_entropy(logits, labels):
    logp = logits - special.logsumexp(logits, axis=-1, keepdims=True)
    return -np.mean(np.take_along_axis(logp, labels[..., None], axis=-1))


NUMPY = SimpleNamespace(
    tanh=np.tanh,
    exp=np.exp,
    log=np.log,
    sqrt=np.sqrt,
    sigmoid=lambda x: 1 / (1 + np.exp(-x)),
    where=np.where,
    sum=np.sum,
    mean=np.mean,
    var=np.var,
    max=np.max,
    logsumexp=special.logsumexp,
    softmax=_np_softmax,
    log_softmax=lambda x, axis: x - special.logsumexp(x, axis=axis, keepdims=True),
    reshape=np.reshape,
    transpose=np.transpose,
    broadcast_to=np.broadcast_to,
    expand_dims=np.expand_dims,
    concatenate=np.concatenate,
    stack=np.stack,
    take=lambda x, idx, axis: np.take(x, idx, axis=axis),
    cross_entropy=_np_cross_entropy,
)
BACKPLAN = SimpleNamespace(
    tanh=bp.tanh,
    exp=bp.exp,
    log=bp.log,
    sqrt=bp.sqrt,
    sigmoid=bp.sigmoid,
    where=bp.where,
    sum=bp.sum,
    mean=bp.mean,
    var=bp.var,
    max=bp.max,
    logsumexp=bp.logsumexp,
    softmax=bp.softmax,
    log_softmax=bp.log_softmax,
    reshape=bp.reshape,
    transpose=bp.transpose,
    broadcast_to=bp.broadcast_to,
    expand_dims=bp.expand_dims,
    concatenate=bp.concatenate,
    stack=bp.stack,
    take=lambda x, idx, axis: bp.take(x, bp.tensor(idx), axis=axis),
    cross_entropy=lambda logits, labels: bp.cross_entropy(logits, bp.tensor(labels)),
)

# smooth elementwise maps; the monotone ones keep values distinct (so max stays tie-free)
UNARY = {
    "tanh": lambda m, x: m.tanh(x),
    "sigmoid": lambda m, x: m.sigmoid(x),
    "neg": lambda m, x: -x,
    "affine": lambda m, x: x * 1.5 - 0.25,
    "rsub": lambda m, x: 2.0 - x,
    "exp_tanh": lambda m, x: m.exp(m.tanh(x)),
    "square": lambda m, x: x * x,
    "log1p_square": lambda m, x: m.log(x * x + 1.0),
    "sqrt1p_square": lambda m, x: m.sqrt(x * x + 1.0),
    "reciprocal": lambda m, x: 1.0 / (x * x + 1.0),
    "pow": lambda m, x: (m.tanh(x) * m.tanh(x) + 1.0) ** 1.5,
}
MONOTONE = {"tanh", "sigmoid", "neg", "affine", "rsub", "exp_tanh"}
BINARY = {
    "add": lambda m, a, b: a + b,
    "sub": lambda m, a, b: a - b,
    "mul": lambda m, a, b: a * b,
    "div": lambda m, a, b: a / (b * b + 1.0),
}
REDUCTIONS = ("sum", "mean", "var", "logsumexp")


def apply_step(m, kind: str, args: list, params: dict):
    if kind == "unary":
        return UNARY[params["name"]](m, args[0])
    if kind == "binary":
        return BINARY[params["name"]](m, *args)
    if kind == "where":
        cond, a, b = args
        return m.where(cond > 0.0, a, b)
    if kind == "reduce":
        return getattr(m, params["name"])(args[0], params["axes"], keepdims=params["keepdims"])
    if kind == "softmax":
        return getattr(m, params["name"])(args[0], axis=params["axis"])
    if kind == "reshape":
        return m.reshape(args[0], params["shape"])
    if kind == "transpose":
        return m.transpose(args[0], params["perm"])
    if kind == "broadcast":
        x = m.expand_dims(args[0], 0) if params["lead"] else args[0]
        return m.broadcast_to(x, params["shape"])
    if kind == "getitem":
        return args[0][params["key"]]
    if kind == "take":
        return m.take(args[0], params["indices"], params["axis"])
    if kind == "concatenate":
        return m.concatenate(args, axis=params["axis"])
    if kind == "stack":
        return m.stack(args, axis=params["axis"])
    if kind == "matmul":
        return args[0] @ args[1]
    if kind == "cross_entropy":
        return m.cross_entropy(args[0], params["labels"])
    raise ValueError(kind)


# ---- programs ---------------------------------------------------------------------------------


@dataclass
class Step:
    kind: str
    operands: tuple[int, ...]
    params: dict
    shape: tuple[int, ...]
    tie_free: bool = False

    def __repr__(self) -> str:
        shown = {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in self.params.items()}
        return f"{self.kind}{list(self.operands)} {shown} -> {self.shape}"


@dataclass
class Program:
    """Items are inputs (a shape) or steps; a step's operands index earlier items."""

    items: list = field(default_factory=list)

    @property
    def input_shapes(self) -> list[tuple[int, ...]]:
        return [item for item in self.items if isinstance(item, tuple)]

    def run(self, m, inputs):
        inputs, values = list(inputs), []
        for item in self.items:
            if isinstance(item, tuple):
                values.append(inputs.pop(0))
            else:
                values.append(
                    apply_step(m, item.kind, [values[i] for i in item.operands], item.params)
                )
        return values[-1]


def shape_of(item):
    return item if isinstance(item, tuple) else item.shape


def tie_free(item) -> bool:
    return isinstance(item, tuple) or item.tie_free


def broadcasts(*shapes) -> tuple[int, ...] | None:
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        return None


small_dim = st.integers(1, 4)
shapes = st.lists(small_dim, min_size=1, max_size=3).map(tuple)


@st.composite
def broadcastable_to(draw, shape):
    keep = draw(st.integers(0, len(shape)))
    return tuple(d if draw(st.booleans()) else 1 for d in shape[len(shape) - keep :])


def _pick(draw, program, where=lambda item: True):
    candidates = [i for i, item in enumerate(program.items) if where(item)]
    return draw(st.sampled_from(candidates)) if candidates else None


def draw_unary(draw, program):
    i = _pick(draw, program)
    name = draw(st.sampled_from(sorted(UNARY)))
    item = program.items[i]
    return Step("unary", (i,), {"name": name}, shape_of(item), tie_free(item) and name in MONOTONE)


def draw_binary(draw, program):
    i = _pick(draw, program)
    a = shape_of(program.items[i])
    j = _pick(draw, program, lambda item: broadcasts(a, shape_of(item)) is not None)
    name = draw(st.sampled_from(sorted(BINARY)))
    return Step("binary", (i, j), {"name": name}, broadcasts(a, shape_of(program.items[j])))


def draw_where(draw, program):
    i = _pick(draw, program)
    a = shape_of(program.items[i])
    j = _pick(draw, program, lambda item: broadcasts(a, shape_of(item)) is not None)
    ab = broadcasts(a, shape_of(program.items[j]))
    c = _pick(draw, program, lambda item: broadcasts(ab, shape_of(item)) is not None)
    return Step("where", (c, i, j), {}, broadcasts(ab, shape_of(program.items[c])))


def draw_reduce(draw, program):
    i = _pick(draw, program, lambda item: len(shape_of(item)) >= 1)
    if i is None:
        return None
    shape = shape_of(program.items[i])
    names = REDUCTIONS + (("max",) if tie_free(program.items[i]) else ())
    name = draw(st.sampled_from(names))
    axes = tuple(sorted(draw(st.sets(st.integers(0, len(shape) - 1), min_size=1))))
    keepdims = draw(st.booleans())
    out = np.sum(np.zeros(shape), axis=axes, keepdims=keepdims).shape
    return Step("reduce", (i,), {"name": name, "axes": axes, "keepdims": keepdims}, out)


def draw_softmax(draw, program):
    i = _pick(draw, program, lambda item: len(shape_of(item)) >= 1)
    if i is None:
        return None
    ndim = len(shape_of(program.items[i]))
    params = {
        "name": draw(st.sampled_from(["softmax", "log_softmax"])),
        "axis": draw(st.integers(-ndim, ndim - 1)),
    }
    return Step("softmax", (i,), params, shape_of(program.items[i]))


def draw_reshape(draw, program):
    i = _pick(draw, program)
    shape = shape_of(program.items[i])
    size = int(np.prod(shape, dtype=np.int64))
    options = {(size,), tuple(reversed(shape)), shape + (1,), (1,) + shape}
    if len(shape) >= 2:
        options.add((shape[0] * shape[1],) + shape[2:])
    new = draw(st.sampled_from(sorted(options)))
    return Step("reshape", (i,), {"shape": new}, new, tie_free(program.items[i]))


def draw_transpose(draw, program):
    i = _pick(draw, program, lambda item: len(shape_of(item)) >= 2)
    if i is None:
        return None
    shape = shape_of(program.items[i])
    perm = tuple(draw(st.permutations(range(len(shape)))))
    return Step(
        "transpose", (i,), {"perm": perm}, tuple(shape[p] for p in perm), tie_free(program.items[i])
    )


def draw_broadcast(draw, program):
    i = _pick(draw, program)
    shape = shape_of(program.items[i])
    lead = draw(st.booleans()) or 1 not in shape
    new = (
        (draw(st.integers(2, 3)),) + shape
        if lead
        else tuple(draw(st.integers(1, 3)) if d == 1 else d for d in shape)
    )
    return Step("broadcast", (i,), {"lead": lead, "shape": new}, new)


@st.composite
def index_item(draw, size):
    options = [
        st.just(slice(None)),
        st.just(slice(None, None, -1)),
        st.integers(-size, size - 1),
        st.just(slice(None, None, 2)),
    ]
    if size >= 2:
        options += [st.just(slice(1, None)), st.just(slice(-1, 0, -1))]
    return draw(st.one_of(options))


def draw_getitem(draw, program):
    i = _pick(draw, program, lambda item: len(shape_of(item)) >= 1)
    if i is None:
        return None
    shape = shape_of(program.items[i])
    count = draw(st.integers(1, len(shape)))
    if draw(st.booleans()):  # x[..., a, b] indexes the last axes
        key = (Ellipsis,) + tuple(draw(index_item(size)) for size in shape[len(shape) - count :])
    else:
        key = tuple(draw(index_item(size)) for size in shape[:count])
    if draw(st.booleans()):
        key = (None,) + key if draw(st.booleans()) else key + (None,)
    out = np.zeros(shape)[key].shape
    return Step("getitem", (i,), {"key": key}, out, tie_free(program.items[i]))


def draw_take(draw, program):
    i = _pick(draw, program, lambda item: len(shape_of(item)) >= 1)
    if i is None:
        return None
    shape = shape_of(program.items[i])
    axis = draw(st.integers(0, len(shape) - 1))
    count = draw(st.integers(1, 4))
    values = draw(
        st.lists(st.integers(-shape[axis], shape[axis] - 1), min_size=count, max_size=count)
    )
    indices = np.array(values, dtype=np.int64)
    out = np.take(np.zeros(shape), indices, axis=axis).shape
    if axis == 0:
        return Step("getitem", (i,), {"key": indices}, out)
    return Step("take", (i,), {"indices": indices, "axis": axis}, out)


def draw_join(draw, program):
    i = _pick(draw, program, lambda item: len(shape_of(item)) >= 1)
    if i is None:
        return None
    shape = shape_of(program.items[i])
    if draw(st.booleans()):
        j = _pick(draw, program, lambda item: shape_of(item) == shape)
        axis = draw(st.integers(0, len(shape)))
        out = np.stack([np.zeros(shape)] * 2, axis=axis).shape
        return Step("stack", (i, j), {"axis": axis}, out)
    axis = draw(st.integers(0, len(shape) - 1))

    def fits(item):
        other = shape_of(item)
        return len(other) == len(shape) and all(
            a == b for k, (a, b) in enumerate(zip(other, shape, strict=True)) if k != axis
        )

    j = _pick(draw, program, fits)
    out = list(shape)
    out[axis] += shape_of(program.items[j])[axis]
    return Step("concatenate", (i, j), {"axis": axis}, tuple(out))


def draw_matmul(draw, program):
    """x @ W or W @ x with a new weight input W (maybe 1-D, maybe batched)."""
    i = _pick(draw, program, lambda item: len(shape_of(item)) >= 1)
    if i is None:
        return None
    x = shape_of(program.items[i])
    k = draw(st.integers(1, 4))
    if draw(st.booleans()):
        weight = draw(st.sampled_from([(x[-1],), (x[-1], k), (2, x[-1], k)]))
        operands = (i, len(program.items))
    else:
        inner = x[-2] if len(x) >= 2 else x[0]
        weight = draw(st.sampled_from([(k, inner), (inner,)] if len(x) >= 2 else [(k, inner)]))
        operands = (len(program.items), i)
    shapes_in = [x, weight] if operands[0] == i else [weight, x]
    try:
        out = np.matmul(*[np.zeros(s) for s in shapes_in]).shape
    except ValueError:
        return None
    program.items.append(weight)
    return Step("matmul", operands, {}, out)


def draw_cross_entropy(draw, program):
    i = _pick(draw, program, lambda item: len(shape_of(item)) >= 1)
    if i is None:
        return None
    shape = shape_of(program.items[i])
    size = int(np.prod(shape[:-1], dtype=np.int64))
    values = draw(st.lists(st.integers(0, shape[-1] - 1), min_size=size, max_size=size))
    labels = np.array(values, dtype=np.int64).reshape(shape[:-1])
    return Step("cross_entropy", (i,), {"labels": labels}, ())


STEP_DRAWERS = [
    draw_unary,
    draw_binary,
    draw_where,
    draw_reduce,
    draw_softmax,
    draw_reshape,
    draw_transpose,
    draw_broadcast,
    draw_getitem,
    draw_take,
    draw_join,
    draw_matmul,
    draw_cross_entropy,
]


@st.composite
def programs(draw):
    base = draw(shapes)
    program = Program([base])
    if draw(st.booleans()):
        program.items.append(draw(broadcastable_to(base)))
    for _ in range(draw(st.integers(1, 5))):
        drawer = draw(st.sampled_from(STEP_DRAWERS))
        step = drawer(draw, program) or draw_unary(draw, program)
        program.items.append(step)
    return program


# ---- running a program three ways -------------------------------------------------------------


def make_inputs(program, seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape) for shape in program.input_shapes]


def leaves(arrays, requires_grad=True):
    return [bp.tensor(a, requires_grad=requires_grad) for a in arrays]


def grads_of(tensors):
    return [np.zeros(t.shape) if t.grad is None else t.grad.numpy() for t in tensors]


def assert_close(actual, expected, rtol, what):
    actual, expected = np.asarray(actual, dtype=np.float64), np.asarray(expected)
    scale = 1.0 + float(np.max(np.abs(expected), initial=0.0))
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale, err_msg=what)


def fd_check(program, arrays, cotangent, grads, seed):
    def loss(xs):
        return float(np.sum(np.asarray(program.run(NUMPY, xs)) * cotangent))

    terms = np.asarray(program.run(NUMPY, arrays)) * cotangent
    rounding = 1e-15 * (1.0 + float(np.sum(np.abs(terms)))) / FD_EPS

    rng = np.random.default_rng(seed + 1)
    for i, grad in enumerate(grads):
        v = rng.standard_normal(arrays[i].shape)
        plus, minus = list(arrays), list(arrays)
        plus[i], minus[i] = arrays[i] + FD_EPS * v, arrays[i] - FD_EPS * v
        fd = (loss(plus) - loss(minus)) / (2 * FD_EPS)
        analytic = float(np.sum(grad * v))
        bound = 1e-5 * (np.linalg.norm(grad) * np.linalg.norm(v) + abs(fd)) + 10 * rounding
        assert abs(analytic - fd) <= bound, f"input {i}: <grad, v> {analytic!r} vs fd {fd!r}"


# Found by these tests, kept as fixed examples: a region whose output feeds two later regions
# (y used by tanh(y) and by y * tanh(y)), and a vector @ vector product.
DIAMOND = Program(
    [
        (3,),
        Step("unary", (0,), {"name": "affine"}, (3,), True),
        Step("unary", (1,), {"name": "tanh"}, (3,), True),
        Step("binary", (1, 2), {"name": "mul"}, (3,)),
    ]
)
DOT = Program([(3,), (3,), Step("matmul", (0, 1), {}, ())])

SETTINGS = settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.mark.reference
@SETTINGS
@given(program=programs(), seed=st.integers(0, 2**16))
@example(program=DOT, seed=0)
def test_eager_compiled_and_numpy_agree(program, seed):
    arrays = make_inputs(program, seed)
    expected = np.asarray(program.run(NUMPY, arrays))
    compiled = bp.compile(lambda *xs: program.run(BACKPLAN, xs))
    eager_out = program.run(BACKPLAN, leaves(arrays, requires_grad=False))
    compiled_out = compiled(*leaves(arrays, requires_grad=False))
    assert eager_out.shape == compiled_out.shape == expected.shape
    assert eager_out.dtype == compiled_out.dtype == np.float64
    assert_close(eager_out.numpy(), expected, 1e-9, "eager vs numpy")
    assert_close(compiled_out.numpy(), eager_out.numpy(), 1e-12, "compiled vs eager")


@SETTINGS
@given(program=programs(), seed=st.integers(0, 2**16))
@example(program=DIAMOND, seed=0)
@example(program=DOT, seed=0)
def test_gradients_agree_with_finite_differences(program, seed):
    arrays = make_inputs(program, seed)
    out_shape = np.shape(program.run(NUMPY, arrays))
    cotangent = np.random.default_rng(seed + 2).standard_normal(out_shape)

    eager_inputs = leaves(arrays)
    program.run(BACKPLAN, eager_inputs).backward(cotangent)
    compiled_inputs = leaves(arrays)
    bp.compile(lambda *xs: program.run(BACKPLAN, xs))(*compiled_inputs).backward(cotangent)
    weights = bp.tensor(cotangent)
    joint = bp.grad(
        lambda *xs: bp.sum(program.run(BACKPLAN, xs) * weights), argnums=tuple(range(len(arrays)))
    )(*leaves(arrays, requires_grad=False))

    eager, compiled = grads_of(eager_inputs), grads_of(compiled_inputs)
    for i, (e, c, j) in enumerate(zip(eager, compiled, joint, strict=True)):
        assert_close(c, e, 1e-10, f"compiled vs eager, input {i}")
        assert_close(j.numpy(), e, 1e-10, f"bp.grad vs eager, input {i}")
    fd_check(program, arrays, cotangent, eager, seed)


@SETTINGS
@given(program=programs(), seed=st.integers(0, 2**16))
def test_float32_programs_match_float64_numpy(program, seed):
    arrays = [a.astype(np.float32) for a in make_inputs(program, seed)]
    expected = np.asarray(program.run(NUMPY, [a.astype(np.float64) for a in arrays]))
    out = bp.compile(lambda *xs: program.run(BACKPLAN, xs))(*leaves(arrays, requires_grad=False))
    assert out.dtype == np.float32
    assert_close(out.numpy(), expected, 1e-3, "float32 compiled vs float64 numpy")


COMPILED_EXAMPLES = int(os.environ.get("BACKPLAN_HYPOTHESIS_COMPILED_EXAMPLES", "12"))


@settings(
    max_examples=COMPILED_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(program=programs(), seed=st.integers(0, 2**16))
@example(program=DIAMOND, seed=0)
def test_numba_compiled_programs_equal_the_reference_interpreter(program, seed):
    """Each random program's value_and_grad, compiled by Numba, against the reference
    interpreter (each example compiles a plan, so there are fewer of them)."""
    from backplan.runtime.backend import use_backend

    arrays = make_inputs(program, seed)
    out_shape = np.shape(program.run(NUMPY, arrays))
    weights = bp.tensor(np.random.default_rng(seed + 2).standard_normal(out_shape))
    vg = bp.value_and_grad(
        lambda *xs: bp.sum(program.run(BACKPLAN, xs) * weights), argnums=tuple(range(len(arrays)))
    )
    results = {}
    for backend in ("reference", "numba"):
        with use_backend(backend):
            value, grads = vg(*leaves(arrays, requires_grad=False))
            results[backend] = [value.numpy()] + [g.numpy() for g in grads]
    for i, (got, want) in enumerate(zip(results["numba"], results["reference"], strict=True)):
        assert_close(got, want, 1e-9, f"numba vs reference, output {i}")
