"""An array of another framework (anything with __dlpack__: a torch tensor, a JAX array) passed
to a compiled function is refused, naming the argument and the way to pass it. A torch tensor
is hashable, so it was taken as a static argument: its values were frozen into the plan, and a
later call with the same tensor changed in place returned the first call's results (the function
bp.from_torch returns, compiled and called with the torch input, did exactly that)."""

import numpy as np
import pytest

import backplan as bp


class ForeignArray:
    """What a framework's array looks like from outside: shape, dtype, __dlpack__, hashable."""

    __slots__ = ("_array", "shape", "dtype")

    def __init__(self, array: np.ndarray):
        self._array = array
        self.shape, self.dtype = array.shape, array.dtype

    def __dlpack__(self, **kwargs):
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()

    def __array__(self, dtype=None, copy=None):
        return self._array


def as_imported(w, x):
    """As the function bp.from_torch returns reads an input that is not a tensor."""
    return bp.sum((x if isinstance(x, bp.Tensor) else bp.tensor(np.asarray(x))) * w)


def test_an_array_of_another_framework_is_refused_not_frozen_into_the_plan():
    step = bp.compile(as_imported)
    values = np.ones((2, 3), np.float32)
    w = bp.tensor(np.ones(3, np.float32))
    with pytest.raises(bp.TracingError) as info:
        step(w, ForeignArray(values))
    message = str(info.value)
    assert "argument x is a " in message and "ForeignArray of shape (2, 3)" in message
    assert "bp.from_dlpack(x)" in message and "bp.tensor(x)" in message
    assert "test_foreign_array_arguments.py:" in message  # the call's line
    shared = bp.from_dlpack(ForeignArray(values))  # what it says works, and sees a change
    assert step(w, shared).item() == 6.0
    values *= 2.0
    assert step(w, shared).item() == 12.0


def test_a_torch_tensor_is_refused():
    torch = pytest.importorskip("torch")
    step = bp.compile(as_imported)
    x = torch.ones(4, 3)
    with pytest.raises(bp.TracingError, match=r"argument x is a torch\.Tensor of shape \(4, 3\)"):
        step(bp.tensor(np.ones(3, np.float32)), x)
