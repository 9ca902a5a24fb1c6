"""A strided view that plans reshape more than once (attention's heads moved back beside the
features, flattened for a GEMM and kept 3-D for a bias sum; or the same transpose recomputed
for the backward) is copied into contiguous memory once per call, not once per reshape, and
values and gradients stay those of NumPy. The copy is a node of the lowered plan
(ir/strided_copies.py), a buffer the plan places, never an allocation of the driver."""

import numpy as np
import pytest

import backplan as bp
from backplan.runtime.backend import use_backend


def copies_in(plan) -> int:
    """The plan's copies of strided views (an astype to the same dtype)."""
    return sum(n.op == "astype" and n.dtype == n.inputs[0].dtype for n in plan.graph.nodes)


def heads_twice(h, w):
    b, heads, t, d = h.shape
    moved = bp.transpose(h, (0, 2, 1, 3))
    rows = bp.reshape(moved, (b * t, heads * d))
    per_batch = bp.reshape(moved, (b, t, heads * d))
    return bp.sum(bp.tanh(rows @ w)) + bp.sum(bp.sum(per_batch, axis=(0, 1)) ** 2)


def reference(h, w):
    b, heads, t, d = h.shape
    x = h.transpose(0, 2, 1, 3).reshape(b * t, heads * d)
    y = np.tanh(x @ w)
    col = x.sum(axis=0)
    loss = y.sum() + (col**2).sum()
    dx = (1 - y * y) @ w.T + 2 * col
    dw = x.T @ (1 - y * y)
    return loss, dx.reshape(b, t, heads, d).transpose(0, 2, 1, 3), dw


@pytest.mark.parametrize(
    "shape, copies",
    # the heads moved back once, and the bias sum's gradient (a broadcast) split into heads;
    # one time step: the heads need no copy, the broadcast still does
    [((2, 3, 5, 4), 2), ((1, 4, 7, 3), 2), ((3, 2, 1, 33), 1)],
)
def test_one_copy_and_the_values_of_numpy(shape, copies):
    rng = np.random.default_rng(4)
    h = rng.standard_normal(shape)
    w = rng.standard_normal((shape[1] * shape[3], 7)) / 4
    vg = bp.value_and_grad(bp.compile(heads_twice), argnums=(0, 1))
    args = [bp.tensor(h), bp.tensor(w)]
    with use_backend("numba"):
        compiled = vg.trace(*args).runner().compiled
        value, (dh, dw) = vg(*args)
    assert copies_in(compiled.plan) == copies
    assert "ascontiguousarray" not in compiled.source
    loss, dh_want, dw_want = reference(h, w)
    np.testing.assert_allclose(float(value.numpy()), loss, rtol=1e-10)
    np.testing.assert_allclose(dh.numpy(), dh_want, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(dw.numpy(), dw_want, rtol=1e-9, atol=1e-12)


def _graph(build):
    """A graph of exp(x) (a buffer) viewed by `build`, its result summed."""
    from backplan.ir.builder import Builder
    from backplan.ir.graph import Graph
    from backplan.ir.types import TensorType

    graph = Graph("f")
    b = Builder(graph)
    x = graph.add_input(TensorType("f32", (2, 6, 4)))
    graph.outputs = [build(b, b.exp(x))]
    return graph


def _cols(b, e, first_row, stop):
    """e[first_row:, :, :stop]."""
    return b.slice(e, starts=(first_row, 0, 0), stops=(2, 6, stop), steps=(1, 1, 1))


@pytest.mark.parametrize(
    "build, copied",
    [
        (lambda b, e: b.reshape(_cols(b, e, 0, 2), shape=(2, 6, 2, 1)), 0),  # a size-1 axis
        (lambda b, e: b.reshape(_cols(b, e, 0, 2), shape=(2, 12)), 1),  # merges strided axes
        (lambda b, e: b.reshape(b.transpose(e, perm=(0, 2, 1)), shape=(2, 24)), 1),
        (lambda b, e: b.reshape(_cols(b, e, 1, 4), shape=(24,)), 0),  # the second batch row
        (lambda b, e: b.reshape(e, shape=(12, 4)), 0),
    ],
)
def test_a_copy_only_where_the_driver_cannot_view(build, copied):
    """The rule of codegen/render/placement.py: a leading-axis slice stays contiguous and a
    reshape adding size-1 axes keeps the strides; merging strided axes needs the copy. The
    report names it a copy (the user wrote a reshape)."""
    from backplan.ir.strided_copies import copy_strided_reshapes, is_strided_copy
    from backplan.report.peak_holders import _value_words

    graph = _graph(build)
    new, origin = copy_strided_reshapes(graph, None)
    copies = [n for n in new.nodes if is_strided_copy(n)]
    assert len(copies) == copied and (new is graph) == (copied == 0)
    for copy in copies:
        assert origin[copy].op == "reshape" and _value_words(copy).startswith("copy of")
        assert new.outputs[0].inputs[0] is copy
