"""Random chains of views (transpose, broadcast, slice, reshape) of one input, read by a fused
loop, a reduction, a row kernel or a copy: Numba's compiled plan must equal the reference
interpreter (and NumPy), forward and gradient. A compiled kernel collapses neighbouring loop
dimensions that every access indexes alike and makes its own strided views from a base, an
offset and strides (codegen/render/loops.py, placement.py): a broadcast (stride 0), reversed
or stepped axis merged into a neighbour reads the wrong elements, which only a comparison of
values catches (it found the transpose-then-broadcast merge that 8e9c93f fixed, with that
example left out, in 40 draws). Shapes are odd and small, with size-1 and empty axes; more
draws with BACKPLAN_HYPOTHESIS_VIEW_EXAMPLES."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import backplan as bp
from backplan.runtime.backend import use_backend

EXAMPLES = int(os.environ.get("BACKPLAN_HYPOTHESIS_VIEW_EXAMPLES", "10"))

dims = st.sampled_from([1, 1, 2, 3, 5, 2, 3, 1, 2, 3, 4])


@st.composite
def transpose(draw, shape):
    return ("transpose", tuple(draw(st.permutations(range(len(shape))))))


@st.composite
def broadcast(draw, shape):
    """A new axis anywhere (an expand_dims then broadcast) or none, and size-1 axes grown."""
    shape = list(shape)
    if draw(st.booleans()):
        shape.insert(draw(st.integers(0, len(shape))), 1)
    grown = tuple(draw(st.sampled_from([2, 3])) if d == 1 else d for d in shape)
    return ("broadcast_to", (tuple(shape), grown))


@st.composite
def slice_(draw, shape):
    """Per axis a non-empty range walked forwards or backwards, with steps; now and then none."""
    key = []
    for d in shape:
        step = draw(st.sampled_from([1, 1, 2, -1, -2]))
        lo = draw(st.integers(0, max(d - 1, 0)))
        hi = draw(st.integers(min(lo + 1, d), d))
        if draw(st.integers(0, 15)) == 0:
            hi = lo
        key.append(slice(lo, hi, step) if step > 0 else slice(hi - 1, lo - 1 if lo else None, step))
    return ("slice", tuple(key))


@st.composite
def reshape(draw, shape):
    """Insert or drop a size-1 axis, or merge two neighbours (a copy when they are strided)."""
    choices = ["insert"]
    if 1 in shape:
        choices.append("drop")
    if len(shape) >= 2:
        choices.append("merge")
    kind, shape = draw(st.sampled_from(choices)), list(shape)
    if kind == "insert":
        shape.insert(draw(st.integers(0, len(shape))), 1)
    elif kind == "drop":
        shape.pop(draw(st.sampled_from([k for k, d in enumerate(shape) if d == 1])))
    else:
        k = draw(st.integers(0, len(shape) - 2))
        shape[k : k + 2] = [shape[k] * shape[k + 1]]
    return ("reshape", tuple(shape) or (1,))


def view(m, x, op):
    kind, arg = op
    if kind == "transpose":
        return m.transpose(x, arg)
    if kind == "broadcast_to":
        return m.broadcast_to(m.reshape(x, arg[0]), arg[1])
    if kind == "slice":
        return x[arg]
    return m.reshape(x, arg)


def apply(m, x, ops):
    for op in ops:
        x = view(m, x, op)
    return x


@st.composite
def chains(draw):
    """A slice or not, a transpose, a broadcast (the pattern loops got wrong), then up to two
    views of any kind, and the kernel that reads the result."""
    shape = draw(st.lists(dims, min_size=1, max_size=4))
    if draw(st.integers(0, 9)) == 0:  # an empty axis
        shape[draw(st.integers(0, len(shape) - 1))] = 0
    shape = tuple(shape)
    current, ops = np.empty(shape), []
    kinds = [slice_, transpose, broadcast] if draw(st.booleans()) else [transpose, broadcast]
    kinds += draw(st.lists(st.sampled_from([transpose, broadcast, slice_, reshape]), max_size=2))
    for make in kinds:
        if current.ndim > 4:
            break
        op = draw(make(current.shape))
        ops.append(op)
        current = view(np, current, op)
    return shape, tuple(ops), draw(readers(current.shape))


def consume(m, t, w, reader):
    """The view read by one kind of kernel; w has the view's shape."""
    kind, axis = reader
    if kind == "loop":
        return m.tanh(t * w) + t
    if kind == "sum":
        return m.sum(t * w, axis=axis, keepdims=True) if t.ndim else t * w
    if kind == "softmax":
        return m.softmax(t, axis=-1) * w if t.ndim else t * w
    if kind == "cumsum":
        return m.cumsum(t, axis=axis) * w if t.ndim else t * w
    return m.reshape(t, (-1,)) * m.reshape(w, (-1,))  # a copy of a strided view


def numpy_softmax(t, axis):
    e = np.exp(t - np.max(t, axis=axis, keepdims=True, initial=-np.inf))
    return e / np.sum(e, axis=axis, keepdims=True)


NUMPY = SimpleNamespace(
    tanh=np.tanh,
    sum=np.sum,
    cumsum=np.cumsum,
    softmax=numpy_softmax,
    reshape=np.reshape,
    transpose=np.transpose,
    broadcast_to=np.broadcast_to,
)


@st.composite
def readers(draw, shape):
    kind = draw(st.sampled_from(["loop", "sum", "softmax", "cumsum", "copy"]))
    return kind, draw(st.integers(0, len(shape) - 1)) if shape else 0


# mem10's case: a (2,1,4,3) transpose broadcast over axis 1, which once merged with axis 0
TRANSPOSE_BROADCAST = (
    (2, 1, 3, 4),
    (("transpose", (0, 1, 3, 2)), ("broadcast_to", ((2, 1, 4, 3), (2, 3, 4, 3)))),
)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(chain=chains(), seed=st.integers(0, 2**16))
@example(chain=(*TRANSPOSE_BROADCAST, ("loop", 0)), seed=0)
def test_numba_reads_composed_views_as_the_reference_does(chain, seed):
    shape, ops, reader = chain
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    w = rng.standard_normal(apply(np, x, ops).shape)
    weights = bp.tensor(rng.standard_normal(np.shape(consume(NUMPY, apply(np, x, ops), w, reader))))

    def loss(x, w):
        return bp.sum(consume(bp, apply(bp, x, ops), w, reader) * weights)

    step = bp.value_and_grad(loss, argnums=(0, 1))
    forward = bp.compile(lambda x, w: consume(bp, apply(bp, x, ops), w, reader))
    results = {}
    for backend in ("reference", "numba"):
        with use_backend(backend):
            value, grads = step(bp.tensor(x), bp.tensor(w))
            out = forward(bp.tensor(x), bp.tensor(w))
            results[backend] = [out.numpy(), value.numpy(), *(g.numpy() for g in grads)]
    want = consume(NUMPY, apply(np, x, ops), w, reader)
    np.testing.assert_allclose(results["reference"][0], want, rtol=1e-12, atol=1e-12)
    names = ("forward", "loss", "grad x", "grad w")
    for name, got, expected in zip(names, results["numba"], results["reference"], strict=True):
        assert got.shape == expected.shape, (name, ops, reader)
        np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-9, err_msg=f"{name} {ops}")
