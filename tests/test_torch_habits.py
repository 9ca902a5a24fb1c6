"""PyTorch habits on backplan tensors: each works as in PyTorch, or raises naming backplan's
spelling where PyTorch's op of the same name means something else."""

import inspect
import re

import numpy as np
import pytest

import backplan as bp


def _x(shape=(2, 3)):
    data = np.arange(np.prod(shape), dtype=np.float32).reshape(shape) / 7.0
    return bp.tensor(data, requires_grad=True)


@pytest.mark.parametrize("shape", [(), (1,), (1, 1), (1, 1, 1)])
def test_backward_on_any_one_element_tensor(shape):
    x = _x()
    loss = (x * x).sum().reshape(shape)
    loss.backward()
    np.testing.assert_allclose(x.grad.numpy(), 2 * x.numpy(), rtol=1e-6)


def test_backward_on_several_elements_still_needs_a_gradient():
    x = _x()
    with pytest.raises(bp.BackwardError, match=r"non-scalar tensor of shape \(2,\)"):
        (x * x).sum(axis=1).backward()


def test_size_is_the_count_and_callable_as_torch():
    x = _x((2, 3, 4))
    assert x.size == 24 and x.size + 1 == 25  # NumPy's a.size
    assert x.size() == (2, 3, 4)
    assert (x.size(0), x.size(-1), x.size(1)) == (2, 4, 3)
    with pytest.raises(IndexError, match=r"size\(3\) at .*test_torch_habits.py.*x.shape\[d\]"):
        x.size(3)
    with pytest.raises(IndexError, match="shape \\(\\)"):
        bp.tensor(1.0).size(0)


def test_view_is_reshape_and_dtype_view_is_refused():
    x = _x((2, 3, 4))
    assert x.view(6, 4).shape == (6, 4)
    assert x.view(-1).shape == (24,)
    assert x.view((4, -1)).shape == (4, 6)
    np.testing.assert_array_equal(x.view(4, 6).numpy(), x.numpy().reshape(4, 6))
    with pytest.raises(TypeError, match=r"view\(.*float64.*astype"):
        x.view(np.float64)


@pytest.mark.parametrize("name", ["sum", "mean", "logsumexp"])
def test_reductions_take_dim_and_keepdim(name):
    x = _x((2, 3, 4))
    got = getattr(x, name)(dim=(0, 2), keepdim=True)
    want = getattr(bp, name)(x, axis=(0, 2), keepdims=True)
    assert got.shape == (1, 3, 1)
    np.testing.assert_allclose(got.numpy(), want.numpy())
    assert getattr(bp, name)(x, dim=1).shape == (2, 4)


@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_softmax_like_take_dim(name):
    x = _x((2, 3))
    np.testing.assert_allclose(
        getattr(x, name)(dim=0).numpy(), getattr(bp, name)(x, axis=0).numpy()
    )


def test_shape_ops_take_torch_keywords():
    x = _x((2, 1, 3))
    assert x.squeeze(dim=1).shape == (2, 3)
    assert x.unsqueeze(dim=0).shape == (1, 2, 1, 3)
    assert x.flatten(start_dim=1).shape == (2, 3)
    assert bp.concatenate([x, x], dim=2).shape == (2, 1, 6)
    assert bp.stack([x, x], dim=0).shape == (2, 2, 1, 3)


def test_both_spellings_at_once_are_refused():
    with pytest.raises(TypeError, match="both dim= and axis="):
        _x().sum(dim=0, axis=0)


@pytest.mark.parametrize("name,arg", [("max", "argmax"), ("min", "argmin")])
def test_max_with_dim_names_values_and_indices(name, arg):
    x = _x()
    with pytest.raises(TypeError, match=rf"(values, indices).*axis=1\).*bp.{arg}\(x, axis=1\)"):
        getattr(x, name)(dim=1)
    assert getattr(x, name)(axis=1, keepdim=True).shape == (2, 1)


def test_var_with_dim_names_the_correction():
    with pytest.raises(TypeError, match=r"unbiased.*ddof=0.*n / \(n - 1\)"):
        _x().var(dim=0)


def test_habits_inside_compile():
    @bp.compile
    def f(x):
        return x.view(3, 2).sum(dim=0).softmax(dim=0).sum() * x.size(0)

    x = _x()
    want = np.exp(x.numpy().reshape(3, 2).sum(0))
    np.testing.assert_allclose(f(x).numpy(), 2 * (want / want.sum()).sum(), rtol=1e-6)


@pytest.mark.parametrize("axes", [(0, 1), (-2, -1), (0, -1)])
def test_transpose_of_two_axes_on_2d_is_refused_not_the_identity(axes):
    # np.transpose(x, 0, 1) keeps a 2-d tensor as it is; PyTorch's x.transpose(0, 1) swaps
    with pytest.raises(TypeError, match=r"transpose\(.*test_torch_habits.py.*\(2, 3\).*swapaxes"):
        _x().transpose(*axes)
    with pytest.raises(TypeError, match="keeps the axes in place"):
        bp.transpose(_x(), *axes)


def test_transpose_of_two_axes_on_3d_names_swapaxes():
    with pytest.raises(TypeError, match=r"needs all 3 axes.*x.swapaxes\(0, 2\)"):
        _x((2, 3, 4)).transpose(0, 2)


def test_transposes_with_one_meaning_still_run():
    x = _x((2, 3))
    np.testing.assert_array_equal(x.transpose(1, 0).numpy(), x.numpy().T)  # a swap either way
    np.testing.assert_array_equal(x.transpose((0, 1)).numpy(), x.numpy())  # a sequence: NumPy's
    np.testing.assert_array_equal(x.permute(0, 1).numpy(), x.numpy())  # torch.permute's identity
    np.testing.assert_array_equal(x.swapaxes(0, 1).numpy(), x.numpy().T)
    y = _x((2, 3, 4))
    assert y.transpose(2, 0, 1).shape == y.permute(2, 0, 1).shape == (4, 2, 3)
    assert y.T.shape == (4, 3, 2)


@pytest.mark.parametrize(
    "name, spelling",
    [
        ("t", "x.T"),
        ("float", "astype(bp.float32)"),
        ("numel", "x.size"),
        ("zero_", "immutable"),
        ("std", "bp.sqrt(x.var(axis=d))"),
        ("expand", "bp.broadcast_to(x, shape)"),
        ("masked_fill", "bp.where(mask, value, x)"),
        ("requires_grad_", "bp.tensor(array, requires_grad=True)"),
    ],
)
def test_torch_only_methods_name_backplans_spelling(name, spelling):
    with pytest.raises(
        AttributeError, match=rf"no attribute '{name}' \(PyTorch's .*{re.escape(spelling)}"
    ):
        getattr(_x(), name)
    assert not hasattr(_x(), "to")  # still an AttributeError: duck typing is unchanged


def test_torch_only_functions_name_backplans_spelling():
    with pytest.raises(AttributeError, match=r"no attribute 'cat' \(PyTorch's .*bp.concatenate"):
        bp.cat  # noqa: B018
    with pytest.raises(AttributeError, match=r"no attribute 'nope'$"):
        bp.nope  # noqa: B018


@pytest.mark.parametrize("compiled", [False, True])
def test_layer_norm_with_torchs_normalized_shape_names_both_spellings(compiled):
    x = _x((2, 3, 4))
    weight, bias = np.ones(4, np.float32), np.zeros(4, np.float32)

    def torch_spelling(x, weight, bias):
        return bp.layer_norm(x, (4,), weight, bias)  # F.layer_norm's argument order

    call = bp.compile(torch_spelling) if compiled else torch_spelling
    with pytest.raises(bp.ShapeError) as info:
        call(x, weight, bias)
    message = str(info.value)
    assert message.startswith("layer_norm(f32[2,3,4], (4,), ...): the second argument is the")
    assert "normalized_shape" in message and "call bp.layer_norm(x, weight, bias)" in message
    assert re.search(r"at test_torch_habits\.py:\d+", message)
    with pytest.raises(bp.ShapeError, match=r"x\.reshape\(\*x\.shape\[:-2\], -1\)"):
        bp.layer_norm(x, [3, 4], np.ones((3, 4), np.float32), np.zeros((3, 4), np.float32))
    want = bp.layer_norm(x, bp.tensor(weight), bp.tensor(bias)).numpy()
    centred = x.numpy() - x.numpy().mean(-1, keepdims=True)
    normed = centred / np.sqrt(centred.var(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(want, normed, rtol=1e-5, atol=1e-6)


class Tensor:
    """Another framework's tensor (as torch's, also called Tensor): a shape, a dtype and
    __dlpack__, no __array__."""

    shape, dtype = (2, 3), "float32"

    def __dlpack__(self, stream=None):
        raise NotImplementedError


def test_another_frameworks_tensor_in_an_op_names_it_the_op_and_the_line():
    x = _x()
    line = inspect.currentframe().f_lineno + 2
    with pytest.raises(TypeError) as info:
        x + Tensor()  # noqa: B018 - the error is the point
    message = str(info.value)
    assert message.startswith("add: expected a backplan tensor or a NumPy array")
    assert "got a test_torch_habits.Tensor of shape (2, 3) and dtype float32" in message
    assert "bp.from_dlpack(x)" in message
    assert f"test_torch_habits.py:{line}" in message


@pytest.mark.parametrize(
    ("value", "said"),
    [
        (None, "got None; an argument or a value computed earlier is missing"),
        ("x", "a str ('x')"),
        (0.5, "got a float (0.5); this op takes a tensor, not a Python number: bp.tensor(0.5)"),
    ],
)
def test_a_value_that_is_no_tensor_names_the_op_and_what_it_is(value, said):
    with pytest.raises(TypeError, match=r"^relu: expected a backplan tensor") as info:
        bp.relu(value)
    assert said in str(info.value)
    assert "test_torch_habits.py:" in str(info.value)


def test_a_torch_tensor_inside_a_compiled_function_names_the_op_and_the_line():
    torch = pytest.importorskip("torch")
    step = bp.compile(lambda a: bp.relu(a) * torch.ones(2, 3))
    with pytest.raises(TypeError, match=r"^mul: .*got a torch\.Tensor of shape \(2, 3\)") as info:
        step(_x())
    assert "test_torch_habits.py:" in str(info.value)


def test_differentiating_a_torch_tensor_says_it_is_torchs():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"is a torch\.Tensor of shape \(3,\)") as info:
        bp.value_and_grad(lambda a: a.sum())(torch.ones(3))
    assert "bp.from_dlpack(x)" in str(info.value)
    assert "only backplan's float tensors can be differentiated" in str(info.value)
