"""bfloat16 and float16 are storage dtypes: ops compute in float32 and round their result once
(round to nearest even), promotion follows JAX, and files keep the dtype."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import backplan as bp

BF16 = np.dtype(ml_dtypes.bfloat16)


def _bf16(values):
    return bp.tensor(np.asarray(values, np.float32).astype(BF16))


def test_promotion_follows_jax():
    b, h = _bf16([1.0]), bp.tensor(np.ones(1, np.float16))
    assert (b + h).dtype == np.float32  # neither holds the other's values
    assert (b * 1.5).dtype == BF16  # a Python float is weak
    assert (bp.tensor(np.ones(1, np.int32)) + b).dtype == BF16
    assert (bp.tensor(np.ones(1, np.float32)) + b).dtype == np.float32
    assert (h + bp.tensor(np.ones(1, np.int64))).dtype == np.float16
    assert bp.bfloat16 is ml_dtypes.bfloat16 and bp.float16 is np.float16


@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16)])
def test_sums_accumulate_in_float32(dtype):
    values = np.random.default_rng(3).uniform(0.0, 1.0, 4096).astype(dtype)
    exact = values.astype(np.float64).sum()
    got = float(bp.tensor(values).sum().item())
    # one rounding of the float32 sum; accumulating in 16 bits is off by a percent and more
    assert abs(got - exact) <= abs(exact) * 2.0**-8


@pytest.mark.parametrize("backend", ["reference", "numba"])
def test_a_16_bit_mean_is_summed_and_divided_in_float32(backend):
    """As PyTorch and JAX: a float16 mean whose sum passes 65504 is the mean, not inf (a
    bench transformer's mean(y ** 2) loss was inf in float16), and a bfloat16 mean over an
    axis is the float64 mean rounded once (within a bfloat16 step of it), eager, compiled and
    in a value_and_grad step, whose gradient is 2x/n."""
    from backplan.runtime.backend import use_backend

    big = np.full((512, 256), 1.5, np.float16)
    values = np.random.default_rng(8).standard_normal((64, 300)).astype(BF16)
    exact = values.astype(np.float64).mean(axis=1)
    with use_backend(backend):
        for mean in (bp.mean, bp.compile(bp.mean)):
            got = mean(bp.tensor(big))
            assert got.dtype == np.float16 and float(got.item()) == 1.5
        for rows in (bp.mean(bp.tensor(values), axis=1), bp.compile(bp.mean)(bp.tensor(values), 1)):
            assert rows.dtype == BF16
            step = np.abs(exact) * 2.0**-8
            assert np.all(np.abs(rows.numpy().astype(np.float64) - exact) <= step)
        value, grad = bp.value_and_grad(lambda a: bp.mean(a * a))(bp.tensor(big))
    assert float(value.item()) == 2.25 and grad.dtype == np.float16
    np.testing.assert_array_equal(grad.numpy(), np.float16(3.0 / big.size))


def test_each_op_rounds_once_from_float32():
    rng = np.random.default_rng(0)
    a32, b32 = rng.standard_normal((2, 64)).astype(np.float32)
    a, b = a32.astype(BF16), b32.astype(BF16)
    got = bp.tanh(bp.tensor(a) * bp.tensor(b) + 1.0).numpy()
    product = (a.astype(np.float32) * b.astype(np.float32)).astype(BF16)
    shifted = (product.astype(np.float32) + np.float32(1.0)).astype(BF16)
    expected = np.tanh(shifted.astype(np.float32)).astype(BF16)
    assert got.dtype == BF16
    np.testing.assert_array_equal(got.view(np.uint16), expected.view(np.uint16))


def test_gradients_in_bfloat16_are_within_its_tolerance_of_float64():
    rng = np.random.default_rng(1)
    w64, x64 = rng.standard_normal((8, 4)), rng.standard_normal((16, 8))

    def loss(w, x):
        return bp.mean(bp.tanh(x @ w) ** 2)

    _, g = bp.value_and_grad(loss)(bp.tensor(w64.astype(BF16)), bp.tensor(x64.astype(BF16)))
    _, g64 = bp.value_and_grad(loss)(bp.tensor(w64), bp.tensor(x64))
    assert g.dtype == BF16
    np.testing.assert_allclose(g.numpy().astype(np.float64), g64.numpy(), rtol=5e-2, atol=2e-3)


def test_saved_buffers_of_bfloat16_take_half_the_bytes():
    x = np.random.default_rng(2).standard_normal((32, 64)).astype(np.float32)

    def f(x):
        return bp.tanh(bp.tanh(x) * 2.0).sum()

    for dtype, size in ((np.float32, 4), (BF16, 2)):
        t = bp.tensor(x.astype(dtype), requires_grad=True)
        saved = bp.compile(f)(t).grad_fn.saved_buffers
        assert sum(s.nbytes for s in saved) == 2 * x.size * size


def test_save_tree_and_export_keep_bfloat16(tmp_path):
    params = {"w": _bf16([1.5, -2.25, 3.0e38]), "h": bp.tensor(np.array([0.1], np.float16))}
    bp.save_tree(tmp_path / "p.npz", params)
    back = bp.load_tree(tmp_path / "p.npz")
    assert back["w"].dtype == BF16 and back["h"].dtype == np.float16
    np.testing.assert_array_equal(
        back["w"].numpy().view(np.uint16), params["w"].numpy().view(np.uint16)
    )
    scale = _bf16([0.5, 0.25, 2.0])
    fn = bp.compile(lambda w: bp.exp(w * scale))
    bp.export(fn, params["w"], path=tmp_path / "f.bp")
    out = bp.load(tmp_path / "f.bp")(params["w"])
    assert out.dtype == BF16
    np.testing.assert_array_equal(
        out.numpy().view(np.uint16), fn(params["w"]).numpy().view(np.uint16)
    )


def test_float16_overflow_gives_inf_visibly():
    h = bp.tensor(np.array([300.0], np.float16))
    assert np.isinf((h * h).numpy()).all()  # 90000 > 65504: inf, as in PyTorch
    assert np.isnan((h * h - h * h).numpy()).all()


def test_casts_between_16_bit_dtypes_round_once_from_float32():
    x = np.array([1.0 + 2.0**-9, 70000.0, np.nan], np.float32)
    b = bp.tensor(x).astype(bp.bfloat16)
    np.testing.assert_array_equal(b.numpy().view(np.uint16), x.astype(BF16).view(np.uint16))
    h = b.astype(bp.float16).numpy()
    assert h[1] == np.inf and np.isnan(h[2])
    with pytest.raises(bp.DtypeError, match="int16"):
        b.astype("int16")


def test_saved_dtype_stores_what_backward_keeps_in_bfloat16():
    rng = np.random.default_rng(4)
    x = bp.tensor(rng.standard_normal((32, 64)).astype(np.float32), requires_grad=True)
    w = bp.tensor(rng.standard_normal((64, 64)).astype(np.float32) * 0.2, requires_grad=True)

    def f(x, w):
        return bp.tanh(bp.tanh(x @ w) * 2.0).sum()

    grads, computed = {}, {}
    for dtype in (None, bp.bfloat16):
        y = bp.compile(f, saved_dtype=dtype)(x, w)
        saved = y.grad_fn.saved_buffers
        computed[dtype] = sum(s.nbytes for s in saved if s.name not in ("x", "w"))
        assert {s.nbytes for s in saved if s.name in ("x", "w")} == {x.nbytes, w.nbytes}
        y.backward()
        grads[dtype] = w.grad.numpy()
        w.grad = x.grad = None
    assert computed[bp.bfloat16] * 2 == computed[None] == 2 * 32 * 64 * 4
    assert grads[bp.bfloat16].dtype == np.float32
    np.testing.assert_allclose(grads[bp.bfloat16], grads[None], rtol=3e-2, atol=3e-2)
    assert not np.array_equal(grads[bp.bfloat16], grads[None])  # it did read rounded values
    with pytest.raises(ValueError, match="float dtype"):
        bp.compile(f, saved_dtype=np.int32)


@pytest.mark.parametrize("dtype", [bp.bfloat16, bp.float16])
def test_half_uniform_draws_never_round_up_to_one(dtype):
    """A float32 draw in [1 - ulp/2, 1) rounds to 1.0 in 16 bits: those take the largest value
    below 1 instead, on both executors."""
    from backplan.runtime.backend import use_backend

    key, n = bp.random.key(3), 1 << 16
    wide = bp.random.uniform(key, (n,), bp.float32).numpy()
    assert (wide.astype(dtype) == 1).any()  # plain rounding would give 1.0 for this key
    draws = bp.random.uniform(key, (n,), dtype).numpy()
    below_one = np.float32(
        1.0 - np.finfo(np.float16).eps / 2 if dtype is bp.float16 else 1.0 - 2.0**-8
    )
    assert draws.dtype == dtype and draws.astype(np.float32).max() == below_one
    assert draws.astype(np.float32).min() >= 0
    with use_backend("numba"):
        compiled = bp.compile(lambda k: bp.random.uniform(k, (n,), dtype))(key).numpy()
    np.testing.assert_array_equal(compiled.view(np.uint16), draws.view(np.uint16))
