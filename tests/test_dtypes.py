"""dtypes are kept or refused, never silently changed (a big-endian array is stored in native
order, its values kept): uint8 and int32 work end to end, every other dtype raises DtypeError
naming it and the supported set; int @ float keeps the float."""

from __future__ import annotations

import numpy as np
import pytest

import backplan as bp
from backplan.runtime.backend import use_backend

SUPPORTED = "bool, uint8, int32, int64, bfloat16, float16, float32, float64"

UNSUPPORTED = {
    "float128": (np.ones(3, np.longdouble), ".astype(np.float32)"),
    "complex64": (np.array([1 + 2j], np.complex64), ".real and .imag"),
    "uint64": (np.array([2**63 + 5], np.uint64), ".astype(np.int64)"),
    "int16": (np.ones(2, np.int16), ".astype(np.int64)"),
    "datetime64[s]": (np.array(["2024-01-01"], "datetime64[s]"), "datetimes"),
    "[('a', '<f4'), ('b', '<i8')]": (np.zeros(2, [("a", "f4"), ("b", "i8")]), "field"),
    "object": (np.array([1.0, None], dtype=object), "numeric"),
}


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_unsupported_arrays_are_refused_naming_the_dtype(name):
    array, fix = UNSUPPORTED[name]
    with pytest.raises(bp.DtypeError) as info:
        bp.tensor(array)
    message = str(info.value)
    assert name in message and SUPPORTED in message and fix in message
    assert "test_dtypes.py:" in message  # the user's line


def test_a_cast_does_not_hide_an_unsupported_source():
    with pytest.raises(bp.DtypeError, match="complex"):
        bp.tensor(np.array([1 + 2j]), dtype="float32")  # NumPy would drop the imaginary part
    with pytest.raises(bp.DtypeError, match="int16"):
        bp.tensor([1.0]).astype("int16")


@pytest.mark.parametrize("dtype", [">f4", ">f8", ">f2", ">i4", ">i8", ">u1"])
def test_a_big_endian_array_is_stored_in_native_order_with_its_values(dtype):
    """A FITS, .mat or network file reads as big-endian: the same values, which NumPy's own
    arithmetic converts; so does backplan, refusing only a dtype it refuses in any order."""
    array = (np.arange(6).reshape(2, 3) * 3 + 1).astype(dtype)
    t = bp.tensor(array)
    assert t.dtype == array.dtype.newbyteorder("=") and t.dtype.isnative
    np.testing.assert_array_equal(t.numpy(), array)
    rows, native_rows = bp.tensor([array[0], array[1]]), bp.tensor([*array.astype(t.dtype)])
    assert rows.dtype == native_rows.dtype and rows.dtype.isnative  # a list as a native one
    np.testing.assert_array_equal(rows.numpy(), native_rows.numpy())
    cast = bp.tensor(array, dtype="float64")
    np.testing.assert_array_equal(cast.numpy(), array.astype(np.float64))
    with pytest.raises(bp.DtypeError, match="int16"):
        bp.tensor(np.ones(2, ">i2"))


def test_a_compiled_call_reads_a_big_endian_argument_by_value():
    """After native arrays took the fast path (and the driver read their buffers in place), a
    big-endian argument of the same shape must not be read as native bytes."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 8)).astype(np.float32)
    w = rng.standard_normal((8, 3)).astype(np.float32)
    step = bp.compile(bp.value_and_grad(lambda w, x: bp.sum(bp.tanh(x @ w) ** 2)))
    with use_backend("numba"):
        want_loss, want_grad = step(w, x)
        step(w, x)
        step(w, x)
        assert step.driver_tier == "direct"
        loss, grad = step(w.astype(">f4"), x.astype(">f4"))
        assert step.driver_tier == "direct"
    assert loss.item() == want_loss.item()
    np.testing.assert_array_equal(grad.numpy(), want_grad.numpy())
    assert step.cache_info().traces == 1
    with use_backend("reference"):
        ref_loss, ref_grad = step(w.astype(np.float64), x.astype(np.float64))
    np.testing.assert_allclose(loss.item(), ref_loss.item(), rtol=1e-5)
    np.testing.assert_allclose(grad.numpy(), ref_grad.numpy(), rtol=1e-4, atol=1e-6)


def test_a_compiled_call_refusing_an_argument_names_it_and_the_line():
    step = bp.compile(lambda params, x: bp.sum(params["w"] * x))
    with pytest.raises(bp.DtypeError) as info:
        step({"w": np.ones(3, np.float32)}, np.ones(3, np.complex64))
    message = str(info.value)
    assert "argument x:" in message and "complex64" in message and "test_dtypes.py:" in message
    with pytest.raises(bp.DtypeError, match=r"argument params\['w'\]: dtype uint64"):
        step({"w": np.ones(3, np.uint64)}, np.ones(3, np.float32))


@pytest.mark.parametrize("transform", [bp.value_and_grad, bp.grad])
def test_a_differentiated_call_refusing_an_argument_names_the_function(transform):
    """value_and_grad binds by position through a stand-in: its refusal named that stand-in,
    `_positional.<locals>.call_through(): argument args[1]`, not the user's function and x."""

    def loss(params, x):
        return bp.sum(params["w"] * x)

    step = transform(loss)
    with pytest.raises(bp.DtypeError) as info:
        step({"w": np.ones(3, np.float32)}, np.ones(3, np.complex64))
    message = str(info.value)
    assert ".loss(): argument x: dtype complex64" in message, message  # as bp.compile says
    assert "test_dtypes.py:" in message and "call_through" not in message
    with pytest.raises(bp.DtypeError, match=r"\.loss\(\): argument params\['w'\]: dtype uint64"):
        step({"w": np.ones(3, np.uint64)}, np.ones(3, np.float32))


@pytest.mark.parametrize("dtype", [np.uint8, np.int32, np.int64, np.float16, np.float32])
def test_a_list_of_numpy_values_keeps_their_dtype(dtype):
    """As np.array does; an int32 row list was refused as Python ints beyond int64."""
    rows = [np.arange(3, dtype=dtype), np.arange(3, 6, dtype=dtype)]
    for data in (rows, [dtype(1), dtype(2)]):
        t = bp.tensor(data)
        assert t.dtype == dtype
        np.testing.assert_array_equal(t.numpy(), np.array(data))


def test_python_ints_beyond_int64_are_refused_not_wrapped():
    with pytest.raises(bp.DtypeError, match="int64 range"):
        bp.tensor([2**63 + 5])
    with pytest.raises(bp.DtypeError, match="does not fit"):
        bp.tensor(np.array([1, 2], np.uint8)) + 300


@pytest.mark.parametrize("dtype", [np.uint8, np.int32, np.int64, np.float32, np.float64, np.bool_])
def test_supported_dtypes_are_kept(dtype):
    array = np.arange(4).astype(dtype)
    t = bp.tensor(array)
    assert t.dtype == dtype and t.nbytes == array.nbytes
    assert bp.tensor([1.0, 2.0]).astype(dtype).dtype == dtype


def test_small_integers_follow_numpy_within_their_category():
    a = np.array([200, 100, 7], np.uint8)
    b = np.array([100, 200, 9], np.int32)
    t, u = bp.tensor(a), bp.tensor(b)
    for got, want in [(t + t, a + a), (t - t[::-1], a - a[::-1]), (u * 3, b * 3), (t + u, a + b)]:
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got.numpy(), want)
    assert t.sum().dtype == np.int64 and t.sum().item() == 307  # no wrap, as NumPy
    assert t.max().dtype == np.uint8 and (t < 150).dtype == np.bool_


@pytest.mark.parametrize("int_dtype", [np.uint8, np.int32, np.int64])
def test_int_with_float_tensor_keeps_the_float_dtype(int_dtype):
    x = np.array([[1, 2], [3, 4]], int_dtype)
    w = np.array([[0.5], [0.25]], np.float32)
    out = bp.tensor(x) @ bp.tensor(w)
    assert out.dtype == np.float32  # NumPy 2 would give float64; PyTorch and JAX float32
    np.testing.assert_allclose(out.numpy(), x.astype(np.float64) @ w, rtol=1e-6)
    assert (bp.tensor(x) * bp.tensor(w.ravel())).dtype == np.float32
    assert (bp.tensor(x) / 2).dtype == np.float64  # true division of integers, as NumPy


def test_the_mean_of_bools_is_float32_and_of_integers_float64():
    """A bool mean is the default float, as JAX (an accuracy beside float32 losses), counted
    exactly first; integers keep NumPy's float64 (their values may need more than 24 bits)."""
    pred = np.arange(10) % 3 == 0  # 4 of 10
    for mean in (bp.mean, bp.compile(bp.mean)):
        out = mean(bp.tensor(pred))
        assert out.dtype == np.float32 and out.item() == np.float32(0.4)
    rows = bp.mean(bp.tensor(pred.reshape(2, 5)), axis=1, keepdims=True)
    assert rows.dtype == np.float32 and (rows.numpy() == np.float32(0.4)).all()
    assert bp.tensor(pred).mean().dtype == np.float32
    assert bp.mean(bp.tensor(np.arange(4))).dtype == np.float64
    assert np.isnan(bp.mean(bp.tensor(np.zeros(0, bool))).item())


@pytest.mark.parametrize("index_dtype", [np.uint8, np.int32])
def test_small_integer_indices_and_labels_give_the_int64_answers(index_dtype):
    rng = np.random.default_rng(0)
    weight = bp.tensor(rng.standard_normal((5, 3)).astype(np.float32), requires_grad=True)
    labels64 = np.array([4, 0, 2, 2])
    labels = labels64.astype(index_dtype)
    results = []
    for lab in (labels64, labels):
        weight.zero_grad()
        rows = bp.embedding(bp.tensor(lab), weight)
        loss = bp.cross_entropy(rows, bp.tensor(lab[:4] % 3)) + bp.one_hot(bp.tensor(lab), 5).sum()
        loss = loss + bp.take(weight, bp.tensor(lab), axis=0).sum()
        loss.backward()
        results.append((loss.item(), weight.grad.numpy().copy()))
    assert results[0][0] == results[1][0]
    np.testing.assert_array_equal(results[0][1], results[1][1])


def test_small_integer_programs_compile_like_the_reference():
    def program(img, idx, w):
        scaled = img.astype("float32") / 255.0
        rows = bp.embedding(idx, w)
        return (
            img + img,  # uint8 wraps, as NumPy
            img.max(axis=1),
            img.sum(),
            idx * 3 - 7,
            bp.astype(idx, "uint8"),
            bp.cross_entropy(rows, idx),
            bp.one_hot(idx, 4),
            (scaled @ bp.ones((6, 1))).sum(),
            idx.astype("int64") + w[:3, 0],
        )

    img = bp.tensor((np.arange(24, dtype=np.uint8) * 11).reshape(4, 6))
    idx = bp.tensor(np.array([2, 0, 1], np.int32))
    w = bp.tensor(np.random.default_rng(1).standard_normal((5, 3)).astype(np.float32))
    reference = program(img, idx, w)
    with use_backend("numba"):
        compiled = bp.compile(program)(img, idx, w)
    for want, got in zip(reference, compiled, strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6)


def test_dtype_names_as_torch_and_jax_users_write_them():
    assert bp.zeros((2,), dtype=bp.float32).dtype == np.float32
    assert bp.tensor([1, 2], dtype=bp.float64).dtype == np.float64
    assert bp.astype(bp.tensor([1.5, -2.5]), bp.int32).numpy().tolist() == [1, -2]
    assert bp.ones((1,), dtype=bp.bool_).dtype == np.bool_
    assert {bp.int64, bp.uint8} == {np.int64, np.uint8}
