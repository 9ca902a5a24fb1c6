"""Repeat calls of a planned function take the lean path: the last signature's guard compares the
arguments in place, and nothing is bound or hashed. It must accept exactly the calls whose
structural key is the same, so a new shape, dtype, structure or static value still retraces
(with the reason), and threads calling with different signatures each get their own results."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import run_in_threads

import backplan as bp
from backplan.runtime.backend import use_backend
from backplan.tracer.fastpath import call_key, guard_for
from backplan.tracer.signature import SignatureKey


def f32(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


BASE = (
    {"w": bp.tensor(f32(3, 2), requires_grad=True), "b": bp.tensor(f32(2))},
    f32(4, 3),
    [1.5, 2],
)
NAN = float("nan")


def _variants():
    """(name, args, kwargs) calls to compare with BASE; some have BASE's key, most do not."""
    w, b = BASE[0]["w"], BASE[0]["b"]
    yield "same objects", BASE, {}
    yield (
        "new tensors, same key",
        (
            {"w": bp.tensor(f32(3, 2, seed=1), requires_grad=True), "b": bp.tensor(f32(2))},
            f32(4, 3, seed=2),
            [0.25, 2],
        ),
        {},
    )
    yield "shape", ({"w": w, "b": b}, f32(5, 3), [1.5, 2]), {}
    yield "dtype", ({"w": w, "b": b}, f32(4, 3).astype(np.float64), [1.5, 2]), {}
    yield "requires_grad", ({"w": bp.tensor(f32(3, 2)), "b": b}, f32(4, 3), [1.5, 2]), {}
    yield "tensor for array", ({"w": w, "b": b}, bp.tensor(f32(4, 3)), [1.5, 2]), {}
    yield "array for tensor", ({"w": w, "b": f32(2)}, f32(4, 3), [1.5, 2]), {}
    yield "key order", ({"b": b, "w": w}, f32(4, 3), [1.5, 2]), {}
    yield "extra key", ({"w": w, "b": b, "c": b}, f32(4, 3), [1.5, 2]), {}
    yield "static int", ({"w": w, "b": b}, f32(4, 3), [1.5, 3]), {}
    yield "bool for int", ({"w": w, "b": b}, f32(4, 3), [1.5, True]), {}
    yield "int for float", ({"w": w, "b": b}, f32(4, 3), [1, 2]), {}
    yield "tuple for list", ({"w": w, "b": b}, f32(4, 3), (1.5, 2)), {}
    yield "longer list", ({"w": w, "b": b}, f32(4, 3), [1.5, 2, 3]), {}
    yield "extra argument", (*BASE, None), {}
    yield "keyword", BASE, {"scale": 2.0}
    yield "subclass", ({"w": w, "b": b}, f32(4, 3).view(np.matrix), [1.5, 2]), {}


@pytest.mark.parametrize("name,args,kwargs", list(_variants()), ids=lambda v: str(v)[:20])
@pytest.mark.parametrize("grad_enabled", [True, False])
def test_the_guard_matches_exactly_when_the_call_key_is_equal(name, args, kwargs, grad_enabled):
    key, _ = call_key(BASE, {}, True)
    guard = guard_for(key)
    want, want_leaves = call_key(args, kwargs, grad_enabled)
    leaves = guard(args, kwargs, grad_enabled)
    assert (leaves is not None) == (want == key), name
    if leaves is not None:
        assert [id(x) for x in leaves] == [id(x) for x in want_leaves], name


@pytest.mark.parametrize(
    "static,other,same",
    [(2.5, 2.5, True), (2.5, 3.5, False), (NAN, NAN, True), (NAN, float("nan"), False)],
)
def test_the_guard_compares_static_floats_as_the_key_does(static, other, same):
    """Floats of static arguments are part of the key, compared like tuple items (a NaN
    matches itself only)."""
    x = bp.tensor(f32(2))
    key, _ = call_key((x, static), {}, True, static_nums=frozenset({1}))
    assert (guard_for(key)((x, other), {}, True) is not None) == same
    assert (call_key((x, other), {}, True, static_nums=frozenset({1}))[0] == key) == same


def test_the_guard_refuses_a_donated_tensor_so_the_full_path_raises():
    step = bp.compile(lambda p, g: p - g, donate_argnums=0)
    p = bp.tensor(np.ones(3, np.float32))
    g = bp.tensor(np.ones(3, np.float32))
    for _ in range(3):
        p = step(p, g)
    old = p
    step(old, g)
    with pytest.raises(bp.DonatedError):
        step(old, g)


def _loss(params, x):
    return bp.sum(bp.tanh(x @ params["w"] + params["b"]) ** 2)


def _params(seed=0):
    return {"w": f32(3, 2, seed=seed), "b": f32(2, seed=seed + 1)}


def _expected(params, x):
    """Value and gradients of _loss in float64 NumPy."""
    w, b, x = (np.float64(a) for a in (params["w"], params["b"], x))
    h = np.tanh(x @ w + b)
    dz = 2 * h * (1 - h**2)
    return np.sum(h**2), {"w": x.T @ dz, "b": dz.sum(0)}


def _check(result, params, x):
    value, grads = result
    want_value, want_grads = _expected(params, x)
    np.testing.assert_allclose(value.numpy(), want_value, rtol=1e-5)
    for k in want_grads:
        np.testing.assert_allclose(grads[k].numpy(), want_grads[k], rtol=1e-4, atol=1e-6)


@pytest.mark.filterwarnings("ignore::backplan.Float64PromotionWarning")  # float64 meant here
@pytest.mark.parametrize("backend", ["numba", "reference"])
def test_a_new_shape_or_dtype_after_lean_calls_retraces_and_says_why(backend):
    step = bp.value_and_grad(bp.compile(_loss))
    params, x = _params(), f32(4, 3)
    with use_backend(backend):
        for kind in ("numpy", "tensor", "numpy"):  # both kinds, each repeated: lean calls
            args = (
                (params, x)
                if kind == "numpy"
                else ({k: bp.tensor(v) for k, v in params.items()}, bp.tensor(x))
            )
            for _ in range(3):
                _check(step(*args), params, x)
        assert step.cache_info().traces == 1
        wide = f32(6, 3, seed=3)
        _check(step(params, wide), params, wide)
        assert step.cache_info().traces == 2
        assert "(4, 3) -> (6, 3)" in step.cache_info().last_miss_reason
        _check(step(params, x), params, x)  # the first signature is still cached
        assert step.cache_info().traces == 2
        doubles = {k: v.astype(np.float64) for k, v in params.items()}
        _check(step(doubles, x), params, x)
        assert step.cache_info().traces == 3
        assert "dtype f32 -> f64" in step.cache_info().last_miss_reason


def test_alternating_tensor_and_numpy_calls_of_one_signature_hash_no_signature_key(monkeypatch):
    step = bp.value_and_grad(bp.compile(_loss))
    params, x = _params(), f32(4, 3)
    tensors = ({k: bp.tensor(v) for k, v in params.items()}, bp.tensor(x))
    step(params, x)
    step(params, x)
    step(*tensors)
    step(*tensors)  # both kinds have their fast path now
    hashes = []
    plain_hash = SignatureKey.__hash__
    monkeypatch.setattr(SignatureKey, "__hash__", lambda key: hashes.append(1) or plain_hash(key))
    for _ in range(4):
        _check(step(params, x), params, x)
        _check(step(*tensors), params, x)
    assert not hashes
    assert step.cache_info().hits >= 10


def test_threads_calling_one_function_with_two_signatures_get_their_own_results():
    """Each thread's calls miss the guard the other thread's calls left behind: they take the
    keyed path, and every result is still the one for its own arguments."""
    step = bp.value_and_grad(bp.compile(_loss))
    data = [(_params(seed), f32(4 + 3 * seed, 3, seed=seed)) for seed in (0, 1)]
    failures = []

    def worker(k):
        params, x = data[k]
        tensors = ({n: bp.tensor(v) for n, v in params.items()}, bp.tensor(x))
        want_value, _ = _expected(params, x)
        for call in range(60):
            value, grads = step(*tensors) if call % 2 else step(params, x)
            if not math.isclose(value.item(), want_value, rel_tol=1e-5):
                failures.append((k, call, value.item(), want_value))
            if grads["w"].shape != (3, 2):
                failures.append((k, call, grads["w"].shape))

    with use_backend("numba"):
        for k in (0, 1):
            worker(k)  # trace both signatures first
        run_in_threads(worker, (0, 1))
    assert not failures
    assert step.cache_info().traces == 2


def test_outputs_the_driver_leaves_in_their_buffers_match_the_reference():
    """`run` returns only what its caller does not hold: buffers (whole or reshaped) come from
    the caller's side, inputs, broadcasts and literals still as before."""

    def many(x, y):
        return (
            bp.sum(x * y),  # a scalar buffer
            bp.sum(x, axis=0, keepdims=True).reshape(-1),  # a reshape of a buffer
            x * 2.0,  # a whole buffer
            x,  # an input
            bp.broadcast_to(bp.sum(y), (2, 3)),  # a broadcast view
            bp.zeros((2,)),  # a literal
        )

    x, y = f32(4, 3), f32(4, 3, seed=1)
    with use_backend("reference"):
        want = [a.numpy() for a in bp.compile(many)(x, y)]
    step = bp.compile(many)
    with use_backend("numba"):
        for _ in range(3):
            got = step(bp.tensor(x), y)
            assert [a.shape for a in got] == [w.shape for w in want]
            for a, w in zip(got, want, strict=True):
                np.testing.assert_allclose(a.numpy(), w, rtol=1e-5, atol=1e-6)
                assert not a.numpy().flags.writeable
