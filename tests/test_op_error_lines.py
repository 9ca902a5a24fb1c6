"""Bad inputs to ops that raised without the user's line (pools, arange, indexing) name the op,
the values and the line, as the other ops' errors do."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import backplan as bp


def _x(*shape):
    return bp.tensor(np.zeros(shape, np.float32))


CASES = [
    ("max_pool2d of 3-d", lambda: bp.max_pool2d(_x(3, 8, 8), 2), bp.ShapeError,
     "max_pool2d: input must be (N, C, H, W), got shape (3, 8, 8)"),
    ("max_pool2d too big", lambda: bp.max_pool2d(_x(1, 1, 1, 1), 2), bp.ShapeError,
     "max_pool2d: kernel (2, 2) does not fit input (1, 1)"),
    ("avg_pool2d padding", lambda: bp.avg_pool2d(_x(1, 1, 4, 4), 2, padding=2), bp.ShapeError,
     "avg_pool2d: padding must be at most half the kernel, got (2, 2)"),
    ("arange step 0", lambda: bp.arange(0, 3, 0), bp.ShapeError,
     "arange(0, 3, step=0): the step must not be zero"),
    ("index out of range", lambda: _x(2, 3)[5], IndexError,
     "getitem: index 5 is out of range for axis 0 of size 2"),
    ("float index", lambda: _x(2, 3)[0, 0.5], IndexError,
     "getitem: index 0.5 on axis 1 is a float; indices are integers"),
    ("ones of a float", lambda: bp.ones(2.5), bp.ShapeError,
     "ones: the shape must be an int or a tuple of ints, got 2.5 (float)"),
    ("zeros of a string", lambda: bp.zeros("3"), bp.ShapeError,
     "zeros: the shape must be an int or a tuple of ints, got '3' (str)"),
    ("full of a float size", lambda: bp.full((2, 1.5), 0.0), bp.ShapeError,
     "full: the shape must be an int or a tuple of ints, got (2, 1.5) (tuple)"),
    ("ragged lists", lambda: bp.tensor([[1.0, 2.0], [3.0]]), bp.ShapeError,
     "tensor: nested lists of different lengths cannot make one tensor (its rows hold 2, 1)"),
    ("ragged lists, dtype", lambda: bp.tensor([[1], [2, 3]], dtype="int32"), bp.ShapeError,
     "tensor: nested lists of different lengths cannot make one tensor (its rows hold 1, 2)"),
]  # fmt: skip


@pytest.mark.parametrize(("what", "call", "error", "said"), CASES, ids=[c[0] for c in CASES])
def test_the_error_names_the_op_the_values_and_the_users_line(what, call, error, said):
    line = inspect.getsourcelines(call)[1]
    with pytest.raises(error) as info:
        call()
    assert str(info.value).startswith(said)
    assert f"test_op_error_lines.py:{line}" in str(info.value)


def test_iterating_over_a_tensor_still_stops_at_its_end():
    rows = [row.numpy().tolist() for row in bp.tensor(np.arange(6.0).reshape(3, 2))]
    assert rows == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]


def test_creation_ops_take_one_int_for_a_1d_shape_as_numpy_does():
    """bp.ones(2) (a backward() seed written as in NumPy or PyTorch) was a bare TypeError."""
    assert bp.ones(2).numpy().tolist() == [1.0, 1.0]
    assert bp.zeros(np.int64(3)).shape == (3,)
    assert bp.full(2, 7.0, "int32").numpy().tolist() == [7, 7]
    x = bp.tensor(np.ones((2, 3), np.float32), requires_grad=True)
    bp.mean(x, axis=1).backward(bp.ones(2))
    assert np.allclose(x.grad.numpy(), 1 / 3)


def test_a_traced_shape_error_names_the_file_as_every_other_error_does():
    """The graph builder's errors said the file's full path; every other error its name."""
    fn = bp.compile(lambda x: bp.sum(x.reshape(3, 3)))
    with pytest.raises(bp.ShapeError) as caught:
        fn(np.zeros(10, np.float32))
    message = str(caught.value)
    assert message.startswith("reshape(f32[10]): cannot reshape (10,) into (3, 3) at ")
    assert "test_op_error_lines.py:" in message and __file__ not in message


@pytest.mark.numba
def test_a_plan_falling_back_to_the_interpreter_warns_at_the_users_call_naming_the_op_line():
    """An integer matmul has no compiled form: the warning named backplan's own line
    (runtime/program.py) and no op line, so a user could not tell which product did it."""
    ints = np.ones((2, 4), np.int64), np.ones((4, 3), np.int64)

    def product(x, w):
        return x @ w  # the op's line

    op_line = inspect.getsourcelines(product)[1] + 1
    with pytest.warns(UserWarning, match="runs on the reference interpreter") as caught:
        out = bp.compile(product)(*ints)  # the call's line
    call_line = inspect.currentframe().f_lineno - 1
    np.testing.assert_array_equal(out.numpy(), np.full((2, 3), 4))
    warning = next(w for w in caught if "reference interpreter" in str(w.message))
    assert (warning.filename, warning.lineno) == (__file__, call_line)
    assert f"integer matmul (matmul i64[2,3] at test_op_error_lines.py:{op_line}" in str(
        warning.message
    )


def test_a_fallback_reason_names_the_op_and_its_type_without_a_source_line():
    """A node with no user line (made by a pass, not traced from user code) still names its op
    and type in the interpreter warning's reason: it said only 'integer matmul'."""
    from backplan.codegen.render.opaque import unsupported_reason
    from backplan.ir.lowering import lower

    def product(x, w):
        return x @ w

    ints = np.ones((2, 4), np.int64), np.ones((4, 3), np.int64)
    lowered = lower(bp.compile(product).trace(*ints).program.plans.forward)
    for kernel in lowered.kernels:
        for node in kernel.all_nodes:
            node.loc = None
    assert unsupported_reason(lowered) == "integer matmul (matmul i64[2,3])"
