"""The per-call path of a compiled function and of backward(): what its shortcuts must keep."""

import inspect

import numpy as np
import pytest

import backplan as bp
from backplan.tracer.tensor import _ones_like


@bp.compile
def _loss(w, x):
    return bp.sum(bp.tanh(x @ w))


def _two_calls(w, x):
    first = _loss(w, x)
    second = _loss(w, x)
    return first, second


def test_each_call_site_gets_its_own_line():
    """Locations are cached by code object and instruction offset: two calls in one function
    (the same code, different offsets) name their own lines, and a repeat names the same."""
    w = bp.tensor(np.ones((3, 2), np.float32), requires_grad=True)
    x = bp.tensor(np.ones((4, 3), np.float32))
    start = inspect.getsourcelines(_two_calls)[1]
    for _ in range(2):
        first, second = _two_calls(w, x)
        assert f"via _two_calls at test_call_path.py:{start + 1})" in first.grad_fn.created_at
        assert f"via _two_calls at test_call_path.py:{start + 2})" in second.grad_fn.created_at


def test_freed_message_names_both_lines():
    w = bp.tensor(np.ones((3, 2), np.float32), requires_grad=True)
    x = bp.tensor(np.ones((4, 3), np.float32))
    loss = _loss(w, x)
    line = inspect.currentframe().f_lineno
    loss.backward()
    with pytest.raises(bp.GraphFreedError) as freed:  # a second backward() through it
        loss.backward()
    message = str(freed.value)
    assert f"test_call_path.py:{line + 1}" in message  # the backward() that freed it
    assert f"test_call_path.py:{line + 3}" in message  # the one that failed
    assert f"created at test_call_path.py:{line - 1}" in message


def test_default_gradient_is_a_new_writeable_array_each_time():
    """A consuming backward may use its seed gradient as scratch: the cached ones are copied."""
    data = np.zeros((1, 1), np.float32)
    seed = _ones_like(data)
    assert seed.flags.writeable and seed.dtype == np.float32 and seed.shape == (1, 1)
    seed[...] = 7.0
    again = _ones_like(data)
    assert again is not seed and again[0, 0] == 1.0


def test_repeated_backward_gradients_match_the_reference():
    rng = np.random.default_rng(0)
    w = bp.tensor(rng.standard_normal((3, 2)).astype(np.float32), requires_grad=True)
    x = bp.tensor(rng.standard_normal((4, 3)).astype(np.float32))
    expected = (1 - np.tanh(x.numpy() @ w.numpy()) ** 2).T @ x.numpy()
    for _ in range(3):
        bp.zero_grad(w)
        _loss(w, x).backward()
        np.testing.assert_allclose(w.grad.numpy(), expected.T, rtol=1e-5)


def _step(w, x):
    loss = _loss(w, x)
    loss.backward()
    return loss


def test_a_joint_step_names_its_call_and_its_backward_lines():
    """Once the calls run as one joint plan (runtime/joint_step.py), the call's user line is
    found past the fast path's own frames and backward() hands the gradients over early: the
    region and the freed message still name the user's lines, through the user's frames."""
    w = bp.tensor(np.ones((3, 2), np.float32), requires_grad=True)
    x = bp.tensor(np.ones((4, 3), np.float32))
    start = inspect.getsourcelines(_step)[1]
    for _ in range(4):
        w.grad = None
        loss = _step(w, x)
    line = inspect.currentframe().f_lineno
    assert type(loss.grad_fn).__name__ == "JointRegion"
    made = f"test_call_path.py:{line - 1} (via _step at test_call_path.py:{start + 1})"
    assert loss.grad_fn.created_at == made
    with np.errstate(all="ignore"):
        expected = (1 - np.tanh(x.numpy() @ w.numpy()) ** 2).T @ x.numpy()
    np.testing.assert_allclose(w.grad.numpy(), expected.T, rtol=1e-5)
    again = inspect.currentframe().f_lineno
    with pytest.raises(bp.GraphFreedError) as freed:  # a second backward() through it
        loss.backward()
    message = str(freed.value)
    assert message.startswith(f"backward() at test_call_path.py:{again + 2} ")
    assert f"test_call_path.py:{line - 1} (via _step at test_call_path.py:{start + 2})" in message
    where = loss.grad_fn.freed_by._where  # the first backward(): the joint plan's hand-over
    assert where.api == "backward"
    test_name = "test_a_joint_step_names_its_call_and_its_backward_lines"
    assert [f[0] for f in where.stack] == ["_step", test_name]


def _nested_backward(loss, depth):
    if depth:
        return _nested_backward(loss, depth - 1)
    loss.backward()


def test_a_backward_location_keeps_the_innermost_user_frames_only():
    """backward() named from four nested user functions: the location holds the innermost
    MAX_USER_FRAMES of them, innermost first, and the api backward."""
    from backplan.tracer.source import MAX_USER_FRAMES

    w = bp.tensor(np.ones((3, 2), np.float32), requires_grad=True)
    x = bp.tensor(np.ones((4, 3), np.float32))
    loss = _loss(w, x)
    _nested_backward(loss, 3)
    where = loss.grad_fn.freed_by._where
    assert where.api == "backward"
    assert [f[0] for f in where.stack] == ["_nested_backward"] * MAX_USER_FRAMES
    lines = [f[2] for f in where.stack]
    first = inspect.getsourcelines(_nested_backward)[1]
    assert lines == [first + 3] + [first + 2] * (MAX_USER_FRAMES - 1)
