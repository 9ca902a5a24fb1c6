"""A library function (codegen/kernels) is compiled in one variant per dtype for everything a
plan asks of it: the flags, strides and sizes it takes vary at run time, not in its Numba
signature. Each variant is a compile of seconds from a fresh install (the own GEMM's entry
compiled once per pair of transpose flags: three in an MLP's training step)."""

import importlib
import pkgutil

import numpy as np
import pytest
from numba import types
from numba.core.registry import CPUDispatcher

import backplan as bp
from backplan.codegen import kernels
from backplan.codegen.kernels import matmul
from backplan.runtime.backend import use_backend


def library_dispatchers() -> dict[str, CPUDispatcher]:
    """Every compiled function of codegen/kernels, by 'module.name'."""
    found = {}
    for info in pkgutil.walk_packages(kernels.__path__, kernels.__name__ + "."):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
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


@pytest.mark.parametrize("driver", ["inline", "python"])
def test_an_own_gemm_training_step_compiles_one_variant_of_each_library_function(
    driver, monkeypatch, tmp_path
):
    """x @ w1, then the backward's x^T @ g and g @ w^T: three pairs of transpose flags, one
    read-only input and intermediates in the arena, all through one own_gemm_at."""
    monkeypatch.setenv("BACKPLAN_GEMM", "own")
    monkeypatch.setenv("BACKPLAN_DRIVER", driver)
    monkeypatch.setenv("BACKPLAN_CACHE_DIR", str(tmp_path))  # a cached driver calls no kernel
    rng = np.random.default_rng(7)
    w1, w2 = (bp.tensor(rng.standard_normal(s).astype(np.float32)) for s in [(9, 6), (6, 5)])
    x = rng.standard_normal((4, 9)).astype(np.float32)
    with use_backend("numba"):
        value, grads = bp.value_and_grad(bp.compile(two_layer_loss), argnums=(0, 1))(w1, w2, x)
    expected, expected_grads = bp.value_and_grad(two_layer_loss, argnums=(0, 1))(w1, w2, x)
    np.testing.assert_allclose(value.numpy(), expected.numpy(), rtol=1e-5)
    for got, want in zip(grads, expected_grads, strict=True):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-5)
    assert len(matmul.own_gemm_at.signatures) == 1, matmul.own_gemm_at.signatures
    extra = extra_variants(library_dispatchers())
    assert extra == {}, "\n".join(f"{k}: {v}" for k, v in extra.items())


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
