"""A symbolic plan with 16-bit values (widened to float32 when lowered, ir/widen.py) runs
its sizes on one driver where their code is the same, as a float32 one does: the widened plan
keeps its symbolic plan's shared driver (each new size rendered a driver of its own before),
and every size's values are
those of a plan made for that size alone (dynamic=False), at sizes above, below and between
the first ones; the reference interpreter's too, within 16-bit rounding (it rounds where the
compiled plan keeps float32: 3% apart on a sum that cancels, at any size)."""

import numpy as np
import pytest

import backplan as bp
from backplan.codegen.build import kernel_cache
from backplan.runtime.backend import use_backend

RNG = np.random.default_rng(17)
W = bp.tensor(RNG.standard_normal((6, 4)).astype(np.float32), requires_grad=True)


def bf16_middle(w, x):
    h = bp.astype(bp.tanh(x @ w), bp.bfloat16)
    s = bp.astype(bp.softmax(h, axis=-1) * h, bp.float32)
    return bp.sum(s * bp.mean(x, axis=0)[:4])


def f16_input(w, x):
    h = bp.astype(x, bp.float32) @ w
    return bp.mean(bp.astype(bp.relu(h), bp.float16).astype(bp.float32) * h)


CASES = [(bf16_middle, np.float32), (f16_input, np.float16)]


@pytest.mark.parametrize("fn,dtype", CASES)
def test_every_size_of_a_16_bit_plan_runs_one_driver_with_the_reference_values(fn, dtype):
    step = bp.value_and_grad(bp.compile(fn, dynamic={"x": {0: "batch"}}))
    # (at 17 rows bfloat16 softmax keeps rows local: other code, a driver of its own)
    xs = {n: bp.tensor(RNG.standard_normal((n, 6)).astype(dtype)) for n in (8, 11, 3, 13)}
    with use_backend("numba"):
        for x in xs.values():
            value, grad = step(W, x)
            alone, alone_grad = bp.value_and_grad(bp.compile(fn, dynamic=False))(W, x)
            np.testing.assert_allclose(value.numpy(), alone.numpy(), rtol=1e-3, atol=1e-5)
            np.testing.assert_allclose(grad.numpy(), alone_grad.numpy(), rtol=1e-3, atol=1e-5)
            with use_backend("reference"):
                expected, expected_grad = bp.value_and_grad(fn)(W, x)
            np.testing.assert_allclose(value.numpy(), expected.numpy(), rtol=0.05, atol=5e-3)
            np.testing.assert_allclose(grad.numpy(), expected_grad.numpy(), rtol=0.05, atol=5e-3)
            again, _ = step(W, x)  # the second call: the driver its first call chose
            np.testing.assert_allclose(again.numpy(), value.numpy(), rtol=1e-6)
        first = step.trace(W, xs[8]).runner().compiled
        before = kernel_cache.counts().versions
        step(W, bp.tensor(RNG.standard_normal((12, 6)).astype(dtype)))
        for n in (11, 3, 13):
            later = step.trace(W, xs[n]).runner().compiled
            assert later.source == first.source, n
            assert later._compiled_run is first._compiled_run, n
    assert kernel_cache.counts().versions == before
    assert step.cache_info().traces == 1
