"""The sizes of one symbolic plan keep the first size's answer to "does this row run keep its
values one row at a time?" (ir/row_local.py: only runs of more than CHUNKS rows do): a
bfloat16 softmax first run at 8 rows and then at 20 or 17 runs the same row kernels and
driver (a loop kernel and a driver of their own before), and the other way round; each size's
values are a plan made for that size alone's."""

import numpy as np
import pytest

import backplan as bp
from backplan.codegen.build import kernel_cache
from backplan.ir.row_local import CHUNKS
from backplan.runtime.backend import use_backend

RNG = np.random.default_rng(23)
W = bp.tensor(RNG.standard_normal((6, 4)).astype(np.float32), requires_grad=True)


def bf16_softmax(w, x):
    h = bp.astype(bp.tanh(x @ w), bp.bfloat16)
    s = bp.astype(bp.softmax(h, axis=-1) * h, bp.float32)
    return bp.sum(s * bp.mean(x, axis=0)[:4])


@pytest.mark.parametrize("sizes", [(8, 2 * CHUNKS - 12, 12, CHUNKS + 1), (CHUNKS + 4, 8)])
def test_sizes_on_either_side_of_the_chunk_rows_run_one_driver_and_no_new_kernel(sizes):
    step = bp.value_and_grad(bp.compile(bf16_softmax, dynamic={"x": {0: "batch"}}))
    xs = [bp.tensor(RNG.standard_normal((n, 6)).astype(np.float32)) for n in sizes]
    with use_backend("numba"):
        step(W, xs[0])
        first = step.trace(W, xs[0]).runner().compiled
        before = kernel_cache.counts().versions
        results = []
        for x in xs:
            value, grad = step(W, x)
            again, _ = step(W, x)
            np.testing.assert_array_equal(again.numpy(), value.numpy())
            results.append((value.numpy(), grad.numpy()))
            later = step.trace(W, x).runner().compiled
            assert later.source == first.source, x.shape
            assert later._compiled_run is first._compiled_run, x.shape
        assert kernel_cache.counts().versions == before
        for x, (value, grad) in zip(xs, results, strict=True):
            alone, alone_grad = bp.value_and_grad(bp.compile(bf16_softmax, dynamic=False))(W, x)
            np.testing.assert_allclose(value, alone.numpy(), rtol=1e-3, atol=1e-5)
            np.testing.assert_allclose(grad, alone_grad.numpy(), rtol=1e-3, atol=1e-5)
    assert step.cache_info().traces == 1
