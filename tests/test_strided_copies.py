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
