"""NumPy protocols (ufuncs and array functions keep the graph or refuse), DLPack exchange, and
errors that name the user's line."""

from __future__ import annotations

import numpy as np
import pytest

import backplan as bp


def _leaf(values=(0.5, -1.0, 2.0)):
    return bp.tensor(np.array(values, np.float32), requires_grad=True)


# ---- __array_ufunc__ / __array_function__ -----------------------------------------------------


def test_numpy_functions_on_tensors_keep_the_graph():
    x, y = _leaf(), _leaf()
    via_numpy = np.sum(np.exp(x) * np.tanh(x) + np.maximum(x, 0.0) + np.sin(x), axis=0)
    via_bp = bp.sum(bp.exp(y) * bp.tanh(y) + bp.maximum(y, 0.0) + bp.sin(y), axis=0)
    assert isinstance(via_numpy, bp.Tensor) and via_numpy.grad_fn is not None
    via_numpy.backward()
    via_bp.backward()
    np.testing.assert_allclose(x.grad.numpy(), y.grad.numpy(), rtol=1e-6)


def test_ndarray_operands_and_array_functions_dispatch_to_backplan():
    x = _leaf()
    out = np.ones(3, np.float32) + x
    assert isinstance(out, bp.Tensor) and out.requires_grad
    m = np.reshape(x, (3, 1))
    assert np.transpose(m).shape == (1, 3) and np.matmul(x, x).shape == ()
    assert np.mean(x).item() == pytest.approx(0.5)
    assert np.max(x, axis=0, keepdims=True).shape == (1,)
    assert np.concatenate([x, x]).shape == (6,) and np.stack([x, x], axis=1).shape == (3, 2)
    np.testing.assert_array_equal(np.take(x, [0, 2]).numpy(), [0.5, 2.0])
    assert np.where(x > 0, x, 0.0).requires_grad
    assert np.shape(x) == (3,) and np.ndim(x) == 1
    assert np.allclose(x, [0.5, -1.0, 2.0]) and np.argmax(x) == 2  # answers, not graphs


def test_np_cumsum_on_a_tensor_is_bp_cumsum_with_its_gradient():
    x, y = _leaf(), _leaf()
    via_numpy = np.cumsum(x, axis=0)
    assert isinstance(via_numpy, bp.Tensor)
    expected = np.cumsum([0.5, -1.0, 2.0]).astype(np.float32)
    np.testing.assert_array_equal(via_numpy.numpy(), expected)
    weights = np.array([1.0, 2.0, 3.0], np.float32)
    bp.sum(via_numpy * weights).backward()
    bp.sum(bp.cumsum(y, axis=0) * weights).backward()
    np.testing.assert_array_equal(x.grad.numpy(), [6.0, 5.0, 3.0])  # suffix sums of the weights
    np.testing.assert_array_equal(x.grad.numpy(), y.grad.numpy())


def test_numpy_functions_trace_inside_compile():
    @bp.compile
    def f(a):
        return np.sum(np.tanh(a) * 2.0, axis=0)

    x = _leaf()
    f(x).backward()
    np.testing.assert_allclose(x.grad.numpy(), 2 * (1 - np.tanh(x.numpy()) ** 2), rtol=1e-5)


@pytest.mark.parametrize(
    "call,expected",
    [
        (lambda x: np.arcsin(x), "np.arcsin has no backplan op"),
        (lambda x: np.cumprod(x), "np.cumprod(t.numpy())"),
        (lambda x: np.add.reduce(x), "bp.sum"),
        (lambda x: np.exp(x, out=np.empty(3, np.float32)), "immutable"),
        (lambda x: np.sum(x, dtype=np.float64), "dtype"),
        (lambda x: np.var(x, ddof=1), "ddof=0"),
        (lambda x: np.where(x > 0), "bp.where(condition, x, y)"),
    ],
)
def test_numpy_calls_backplan_cannot_do_raise_instead_of_leaving_the_graph(call, expected):
    with pytest.raises(TypeError) as info:
        call(_leaf())
    assert expected in str(info.value)


def test_asarray_is_an_explicit_read_only_view():
    x = _leaf()
    array = np.asarray(x)
    assert np.shares_memory(array, x.numpy()) and not array.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        x.numpy()[0] = 1.0
    assert "read-only" in bp.Tensor.numpy.__doc__


# ---- DLPack -----------------------------------------------------------------------------------


def test_dlpack_round_trips_with_numpy_without_copying():
    t = bp.tensor(np.arange(6, dtype=np.float32).reshape(2, 3), requires_grad=True)
    exported = np.from_dlpack(t)
    assert np.shares_memory(exported, t.numpy()) and not exported.flags.writeable
    assert t.__dlpack_device__() == (1, 0)
    source = np.arange(4, dtype=np.int32)
    imported = bp.from_dlpack(source)
    assert imported.dtype == np.int32 and np.shares_memory(imported.numpy(), source)
    assert not imported.numpy().flags.writeable and source.flags.writeable
    back = bp.from_dlpack(t)
    assert np.shares_memory(back.numpy(), t.numpy()) and not back.requires_grad


def test_dlpack_refuses_what_it_cannot_share_faithfully():
    with pytest.raises(bp.DtypeError, match="complex"):
        bp.from_dlpack(np.ones(2, np.complex64))
    t = bp.tensor([1.0, 2.0])
    with pytest.raises(BufferError, match="read-only"):
        t.__dlpack__(copy=False)  # a pre-1.0 consumer could write into it
    capsule_array = np.from_dlpack(t)  # a DLPack 1.0 consumer shares the memory
    assert np.shares_memory(capsule_array, t.numpy())


def test_dlpack_with_jax():
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    t = bp.tensor(np.arange(5, dtype=np.float32))
    j = jnp.from_dlpack(t)
    np.testing.assert_array_equal(np.asarray(j), t.numpy())
    back = bp.from_dlpack(jnp.arange(3, dtype=jnp.int32))
    assert back.dtype == np.int32 and back.tolist() == [0, 1, 2]
    assert jax.devices()[0].platform == "cpu"


def test_dlpack_with_torch():
    torch = pytest.importorskip("torch")
    t = bp.tensor(np.arange(5, dtype=np.float32))
    pt = torch.from_dlpack(t)
    assert pt.tolist() == t.tolist()
    source = torch.arange(4, dtype=torch.int32)
    back = bp.from_dlpack(source)
    assert np.shares_memory(back.numpy(), source.numpy())


def test_bfloat16_crosses_dlpack_without_numpys_help():
    """NumPy's DLPack has no bfloat16: the capsule is relabelled both ways, the memory shared."""
    bits = np.array([0x3FC0, 0xC010, 0x7F80, 0x7FC1], np.uint16)  # 1.5, -2.25, inf, a NaN
    t = bp.tensor(bits.view(bp.bfloat16))
    back = bp.from_dlpack(t)  # our capsule (kDLBfloat) read back through NumPy
    assert back.dtype == bp.bfloat16 and np.shares_memory(back.numpy(), t.numpy())
    np.testing.assert_array_equal(back.numpy().view(np.uint16), bits)
    with pytest.raises(RuntimeError, match="dtype"):
        np.from_dlpack(t)  # NumPy itself refuses kDLBfloat: t.numpy() is the NumPy view


def test_dlpack_half_dtypes_with_torch():
    torch = pytest.importorskip("torch", reason="pip install torch")
    source = torch.tensor([1.5, -2.25, 3.0e38, float("nan"), 1e-40], dtype=torch.bfloat16)
    imported = bp.from_dlpack(source)
    assert imported.dtype == bp.bfloat16
    assert imported.numpy().ctypes.data == source.data_ptr()  # zero-copy
    want = source.view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(imported.numpy().view(np.uint16), want)
    exported = torch.from_dlpack(imported)
    assert exported.dtype == torch.bfloat16 and exported.data_ptr() == source.data_ptr()
    mine = bp.tensor(np.array([0.1, 2.0, -7.5], np.float32)).astype(bp.bfloat16)
    theirs = torch.tensor([0.1, 2.0, -7.5]).to(torch.bfloat16)  # both round to nearest even
    assert torch.equal(torch.from_dlpack(mine), theirs)
    assert torch.equal(torch.from_dlpack(mine.__dlpack__()), theirs)  # pre-1.0: a copy
    strided = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)[:, ::2]
    assert bp.from_dlpack(strided).tolist() == strided.float().tolist()
    halves = torch.tensor([1.5, 65504.0], dtype=torch.float16)
    assert bp.from_dlpack(halves).numpy().ctypes.data == halves.data_ptr()
    assert torch.from_dlpack(bp.from_dlpack(halves)).dtype == torch.float16


# ---- errors name the user's line ----------------------------------------------------------------


def _raises_here(error, call, *fragments):
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    assert "test_interop.py:" in message, message
    for fragment in fragments:
        assert fragment in message, message


def test_shape_errors_name_the_op_and_the_line():
    a = bp.tensor(np.ones((2, 3), np.float32))
    _raises_here(bp.ShapeError, lambda: a.sum(axis=3), "sum:", "axis 3")
    _raises_here(bp.ShapeError, lambda: a.mean(axis=(0, 0)), "mean:", "repeated axis")
    _raises_here(bp.ShapeError, lambda: a.item(), "item()", "(2, 3)", "6 elements")
    _raises_here(bp.ShapeError, lambda: a[0, 0, 0], "too many indices")
    _raises_here(bp.ShapeError, lambda: a.reshape(4, 2), "reshape")


def test_swapped_embedding_arguments_say_the_order():
    weight = bp.tensor(np.ones((4, 2), np.float32))
    indices = bp.tensor([0, 3])
    _raises_here(
        bp.DtypeError,
        lambda: bp.embedding(weight, indices),
        "look swapped",
        "embedding(indices, weight)",
    )
    assert bp.embedding(indices, weight).shape == (2, 2)
