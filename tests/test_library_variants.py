"""A library function (codegen/kernels) is compiled in one variant per dtype for everything a
plan asks of it: the flags, strides and sizes it takes vary at run time, not in its Numba
signature. Each variant is a compile of seconds from a fresh install (the own GEMM's entry
compiled once per pair of transpose flags: three in an MLP's training step)."""

import importlib
import os
import pkgutil

import numpy as np
from helpers import script_facts
from numba import types
from numba.core.registry import CPUDispatcher

import backplan as bp
from backplan.codegen import kernels
from backplan.codegen.build import native_calls
from backplan.codegen.kernels import matmul
from backplan.runtime.backend import use_backend


def library_dispatchers() -> dict[str, CPUDispatcher]:
    """Every compiled function of codegen/kernels, by 'module.name'."""
    found = {}
    for info in pkgutil.walk_packages(kernels.__path__, kernels.__name__ + "."):
        module = importlib.import_module(info.name)
        for name, wrapped in vars(module).items():
            value = native_calls.unwrapped(wrapped)  # helpers called by address count too
            if isinstance(value, CPUDispatcher) and value.py_func.__module__ == info.name:
                found[f"{info.name.rsplit('.', 1)[-1]}.{name}"] = value
    return found


def dtypes_of(signature) -> tuple:
    """What two variants must differ in: the element types of their arrays, or the length of
    a tuple (mathlib's polynomials of different degrees are different functions)."""
    return tuple(
        t.dtype
        if isinstance(t, types.Array)
        else len(t)
        if isinstance(t, types.BaseTuple)
        else None
        for t in signature
    )


def extra_variants(dispatchers: dict[str, CPUDispatcher]) -> dict[str, list]:
    """Functions with two signatures of the same dtypes, with their signatures."""
    extra = {}
    for name, dispatcher in dispatchers.items():
        kinds = [dtypes_of(signature) for signature in dispatcher.signatures]
        if len(set(kinds)) < len(kinds):
            extra[name] = dispatcher.signatures
    return extra


def two_layer_loss(w1, w2, x):
    return bp.sum(bp.tanh(bp.tanh(x @ w1) @ w2) ** 2)


def two_convs(w1, w2, x):
    hidden = bp.relu(bp.conv2d(x, w1, padding=(1, 1)))
    return bp.sum(bp.conv2d(hidden, w2, padding=(1, 1)) ** 2)


def steps_and_census(cache_dir: str) -> dict:
    """Training steps of an MLP on the own GEMM and of a two-layer CNN, on both driver tiers,
    checked against the reference; then the library functions with more than one variant per
    dtype (in a fresh process: other tests call library functions with other array types)."""
    rng = np.random.default_rng(7)
    w1, w2 = (bp.tensor(rng.standard_normal(s).astype(np.float32)) for s in [(9, 6), (6, 5)])
    x = rng.standard_normal((4, 9)).astype(np.float32)
    c1, c2 = (
        bp.tensor(rng.standard_normal(s).astype(np.float32)) for s in [(3, 2, 3, 3), (4, 3, 3, 3)]
    )
    image = rng.standard_normal((2, 2, 5, 5)).astype(np.float32)
    for driver in ("inline", "python"):
        os.environ["BACKPLAN_DRIVER"] = driver
        os.environ["BACKPLAN_CACHE_DIR"] = os.path.join(cache_dir, driver)  # compiled afresh
        for loss, args in ((two_layer_loss, (w1, w2, x)), (two_convs, (c1, c2, image))):
            with use_backend("numba"):
                value, grads = bp.value_and_grad(bp.compile(loss), argnums=(0, 1))(*args)
            expected, expected_grads = bp.value_and_grad(loss, argnums=(0, 1))(*args)
            np.testing.assert_allclose(value.numpy(), expected.numpy(), rtol=1e-4)
            for got, want in zip(grads, expected_grads, strict=True):
                np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-4)
    extra = extra_variants(library_dispatchers())
    return {
        "own_gemm_at": [str(s) for s in matmul.own_gemm_at.signatures],
        "extra": {name: [str(s) for s in signatures] for name, signatures in extra.items()},
    }


def test_training_steps_compile_one_variant_of_each_library_function(tmp_path):
    """The MLP's x @ w1, then the backward's x^T @ g and g @ w^T: three pairs of transpose
    flags, a read-only input and intermediates in the arena, all through one own_gemm_at; the
    CNN's three conv kernels through one BLAS entry."""
    script = (
        f"import json, sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
        "from test_library_variants import steps_and_census; "
        f"print(json.dumps(steps_and_census({str(tmp_path)!r})))"
    )
    census = script_facts(script, env={**os.environ, "BACKPLAN_GEMM": "own"})
    assert len(census["own_gemm_at"]) == 1, census["own_gemm_at"]
    assert census["extra"] == {}


def test_the_census_sees_a_second_variant_of_the_same_dtypes():
    """The check above can fail: two calls differing only in a literal flag are two variants."""
    from backplan.codegen.jit import njit

    @njit
    def flagged(flag, x):
        return x[0] if flag else x[-1]

    @njit
    def caller(x):
        return flagged(True, x) + flagged(False, x)

    caller(np.ones(3, np.float32))
    assert list(extra_variants({"flagged": flagged})) == ["flagged"]
    assert dtypes_of(flagged.signatures[0]) == (None, types.float32)
