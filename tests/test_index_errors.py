"""A bad index or label raises the same ExecutionError on the compiled path as on the reference
interpreter, naming the op, the bad value, its position and the user's line: label -1 too, which
the kernels once reported as "all fine" and then read whatever the buffer held."""

import re

import numpy as np
import pytest

import backplan as bp
from backplan.runtime.backend import use_backend


def message_on(backend: str, fn, *args) -> str:
    with use_backend(backend):
        with pytest.raises(bp.ExecutionError) as info:
            fn(*args)
    return str(info.value)


logits = bp.tensor(np.zeros((3, 4), np.float32))
weight = bp.tensor(np.ones((3, 2), np.float32), requires_grad=True)


@pytest.mark.parametrize(
    ("name", "fn", "args", "expected"),
    [
        (
            "cross_entropy",
            lambda logits, labels: bp.cross_entropy(logits, labels),
            (logits, np.array([0, -1, 1])),
            r"cross_entropy at test_index_errors.py:\d+: label -1 at position 1 is out of range "
            r"for 4 classes",
        ),
        (
            "one_hot",
            lambda labels: bp.one_hot(labels, 4),
            (np.array([[0, 1], [2, -1]]),),
            r"one_hot at .*: label -1 at position \(1, 1\) is out of range for 4 classes",
        ),
        (
            "take",
            lambda x, i: x[i],
            (logits, np.array([0, -4])),
            r"take at .*: index -4 at position 1 is out of range for an axis of size 3",
        ),
        (
            "embedding",
            lambda i, w: bp.embedding(i, w).sum(),
            (np.array([[0, 1], [3, 0]]), weight),
            r"take at .*: index 3 at position \(1, 0\) is out of range for an axis of size 3",
        ),
    ],
)
def test_bad_index_raises_the_reference_message_on_the_compiled_path(name, fn, args, expected):
    args = [a if isinstance(a, bp.Tensor) else bp.tensor(a) for a in args]
    compiled = bp.compile(fn)
    reference = message_on("reference", compiled, *args)
    assert re.fullmatch(expected, reference), reference
    assert message_on("numba", compiled, *args) == reference


def test_label_minus_one_in_a_compiled_training_step_raises():
    def loss(w, labels):
        return bp.cross_entropy(bp.tensor(np.eye(3, dtype=np.float32)) @ w, labels)

    step = bp.value_and_grad(bp.compile(loss))
    w = bp.tensor(np.ones((3, 5), np.float32))
    with use_backend("numba"):
        value, _ = step(w, bp.tensor(np.array([0, 4, 2])))  # fine labels compile and run
        assert np.isfinite(value.numpy())
        with pytest.raises(bp.ExecutionError, match=r"label -1 at position 2 is out of range"):
            step(w, bp.tensor(np.array([0, 4, -1])))
