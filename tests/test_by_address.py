"""Library helpers called by address (codegen/kernels/by_address.py): each is compiled once and
its callers call its native entry point instead of linking (and optimising again) its code.
The attention kernels' helpers are; a training step through them gives the reference's values,
and a second process loading the kernels from the cache gives the same bits."""

import os

import numpy as np
import pytest
from helpers import script_facts

from backplan.codegen.jit import AS_PYTHON, njit
from backplan.codegen.kernels.by_address import by_address

SCRIPT = """
import json
import numpy as np
import backplan as bp
from backplan.codegen.build import native_calls
from backplan.codegen.kernels import attention
from backplan.runtime.backend import use_backend

def loss(q, k, v):
    return bp.sum(bp.scaled_dot_product_attention(q, k, v, is_causal=True) ** 2)

rng = np.random.default_rng(3)
q, k, v = (bp.tensor(rng.standard_normal((2, 3, 5, 4)).astype(np.float32)) for _ in range(3))
with use_backend("numba"):
    value, grads = bp.value_and_grad(bp.compile(loss), argnums=(0, 1, 2))(q, k, v)
expected, expected_grads = bp.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
print(json.dumps({
    "value": float(value.item()), "expected": float(expected.item()),
    "grads": [g.numpy().ravel().tolist() for g in grads],
    "expected_grads": [g.numpy().ravel().tolist() for g in expected_grads],
    "published": native_calls.published_here(),
    "matmul_variants": len(native_calls.unwrapped(attention._matmul).signatures),
}))
"""


def test_attention_helpers_are_called_by_address_and_load_in_another_process(tmp_path):
    """Three heads, causal: both directions against the reference; the kernels' helpers are
    symbols published with this process's addresses (linked, none would be); the GEMM helper
    compiles once for the plan's read-only views and the kernels' own workspaces; a second
    process with the same cache folders loads everything and gets the same bits. The library's
    folder is the suite's (kernels loaded from it call their helpers by address just the
    same)."""
    env = {
        **os.environ,
        "BACKPLAN_CACHE_DIR": str(tmp_path / "plans"),
        "BACKPLAN_DRIVER": "python",
    }
    first = script_facts(SCRIPT, env=env)
    np.testing.assert_allclose(first["value"], first["expected"], rtol=1e-5)
    for got, want in zip(first["grads"], first["expected_grads"], strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    published = {label.split("(")[0]: own for label, own in first["published"].items()}
    assert published["backplan.codegen.kernels.attention._head_forward"]
    assert published["backplan.codegen.kernels.attention._head_backward"]
    assert first["matmul_variants"] == 1
    second = script_facts(SCRIPT, env=env)
    assert (second["value"], second["grads"]) == (first["value"], first["grads"])


def test_a_helper_takes_arrays_of_any_layout_in_one_variant():
    """A contiguous array and a strided view reach one compiled helper (arrays=...), and a
    writable one where it is declared read-only; values as the plain function's."""

    def total(x, y):
        s = 0.0
        for i in range(x.shape[0]):
            s += x[i] * y[i]
        return s

    helper = by_address(arrays=(0,), read_only=(1,), cache=False)(total)

    @njit
    def caller(a, b):
        return helper(a, b) + helper(a[::2], b[::2])

    a, b = np.arange(8.0), np.arange(8.0) + 1
    assert caller(a, b) == total(a, b) + total(a[::2], b[::2])
    if not AS_PYTHON:
        assert len(helper.dispatcher.signatures) == 1, helper.dispatcher.signatures


def test_a_helper_without_a_python_wrapper_refuses_a_python_call():
    """Numba would jump into the missing wrapper (a crash): the call raises, naming it."""
    helper = by_address(cache=False, no_cpython_wrapper=True)(lambda x: x + 1)

    @njit
    def caller(x):
        return helper(x)

    assert caller(2) == 3
    if not AS_PYTHON:
        with pytest.raises(TypeError, match="<lambda> is called from compiled code only"):
            helper(2)
