"""Losses refuse a target whose shape differs from the prediction's: mse_loss of a (N, 1)
prediction and (N,) targets broadcast to an (N, N) grid and trained on a wrong loss without an
error (torch only warns)."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import backplan as bp


def _t(*shape):
    return bp.tensor(np.arange(np.prod(shape), dtype=np.float32).reshape(shape))


@pytest.mark.parametrize("compiled", [False, True])
def test_mse_loss_of_a_column_against_a_vector_is_refused_naming_shapes_fix_and_line(compiled):
    loss = bp.compile(bp.mse_loss) if compiled else bp.mse_loss
    line = inspect.currentframe().f_lineno + 2
    with pytest.raises(bp.ShapeError) as info:
        loss(_t(4, 1), _t(4))
    message = str(info.value)
    assert message.startswith("mse_loss(f32[4,1], f32[4]): prediction (4, 1) and target (4,)")
    assert "broadcast to (4, 4)" in message
    assert "target.reshape(4, 1)" in message
    assert f"test_loss_shapes.py:{line}" in message


def test_mse_loss_of_shapes_that_do_not_broadcast_says_so():
    with pytest.raises(bp.ShapeError, match=r"do not broadcast either$|do not broadcast either "):
        bp.mse_loss(_t(4, 3), _t(4))


def test_mse_loss_of_equal_shapes_and_of_a_number_target_is_the_mean_square():
    np.testing.assert_allclose(
        bp.mse_loss(_t(2, 3), _t(2, 3) * 2.0).item(), np.mean(np.arange(6.0) ** 2)
    )
    np.testing.assert_allclose(bp.mse_loss(_t(3), 1.0).item(), np.mean((np.arange(3.0) - 1) ** 2))
