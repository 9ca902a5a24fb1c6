"""A reshape of a strided view (a fused qkv projection sliced into q, k and v, then split into
heads) needs a contiguous copy of the view. That copy is memory the step holds: explain's peak
and the checked mode (BACKPLAN_CHECK_MEMORY) count it, on every call, on both backends, so
what explain prints is what the process holds."""

from __future__ import annotations

import numpy as np
import pytest

import backplan as bp
from backplan.bench.memory_calls import counted_calls, printed_calls
from backplan.codegen.run.memory_check import checked_memory
from backplan.runtime.backend import use_backend

B, T, D, H = 2, 4, 8, 2
CALLS = 5


def fused_qkv(p, x, y):
    qkv = x @ p["wqkv"]
    q, k, v = qkv[:, :, :D], qkv[:, :, D : 2 * D], qkv[:, :, 2 * D :]

    def heads(t):
        return t.reshape(B, T, H, D // H).transpose(0, 2, 1, 3)

    a = bp.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
    a = a.transpose(0, 2, 1, 3).reshape(B, T, D)
    return bp.mse_loss(a @ p["wo"], y)


def arrays(requires_grad: bool):
    rng = np.random.default_rng(3)

    def f(*shape, grad=False):
        array = (rng.standard_normal(shape) * 0.3).astype(np.float32)
        return bp.tensor(array, requires_grad=grad)

    p = {"wqkv": f(D, 3 * D, grad=requires_grad), "wo": f(D, D, grad=requires_grad)}
    return p, f(B, T, D), f(B, T, D)


@pytest.fixture(autouse=True, params=["numba", "reference"])
def backend(request):
    with use_backend(request.param), checked_memory():
        yield request.param


def test_a_fused_qkv_compiled_loss_holds_what_explain_prints_on_every_call(backend):
    p, x, y = arrays(requires_grad=True)
    loss = bp.compile(fused_qkv)
    report = bp.explain(loss, p, x, y)

    def step():
        bp.zero_grad(p)
        loss(p, x, y).backward()

    assert counted_calls(step, CALLS) == printed_calls(report, CALLS)


def test_a_fused_qkv_value_and_grad_holds_what_explain_prints_on_every_call(backend):
    p, x, y = arrays(requires_grad=False)
    vg = bp.value_and_grad(fused_qkv)
    report = bp.explain(vg, p, x, y)
    assert counted_calls(lambda: vg(p, x, y), CALLS) == printed_calls(report, CALLS)
    if backend == "numba":  # no copy the checked mode cannot see: the driver allocates nothing
        source = vg.trace(p, x, y).runner().compiled.source
        assert "ascontiguousarray" not in source and "np.empty" not in source
