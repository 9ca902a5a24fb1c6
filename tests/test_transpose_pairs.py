"""A transpose of a transpose that puts every axis back is the value itself (algebraic
simplification), so a GEMM reads the operand as stored instead of copying it each call:
PyTorch's F.linear(x, w.T) imports as two permutes of w."""

from __future__ import annotations

import re

import numpy as np
import pytest

import backplan as bp
from backplan.codegen.render.emit import generate
from backplan.ir.lowering import lower


def plan_lines(fn, *args) -> list[str]:
    text = str(bp.explain(bp.value_and_grad(fn), *args))
    return text.split("2. Plans")[1].split("3. Saved")[0].splitlines()


def transposes(lines: list[str]) -> list[str]:
    return re.findall(r"= transpose %\d+ \{perm=\(([\d, ]+)\)\}", "\n".join(lines))


@pytest.mark.reference
def test_a_transpose_of_a_transpose_is_the_value_itself_and_the_gemm_copies_nothing():
    rng = np.random.default_rng(0)
    w, x = rng.standard_normal((5, 4)), rng.standard_normal((3, 5))

    def loss(w, x):
        return bp.sum(bp.tanh(x @ w.T.T))

    def plain(w, x):
        return bp.sum(bp.tanh(x @ w))

    assert transposes(plan_lines(loss, w, x)) == transposes(plan_lines(plain, w, x))
    value, grad = bp.value_and_grad(loss)(w, x)
    np.testing.assert_allclose(value.numpy(), np.tanh(x @ w).sum(), rtol=1e-12)
    np.testing.assert_allclose(grad.numpy(), x.T @ (1 - np.tanh(x @ w) ** 2), rtol=1e-12)
    plan = bp.value_and_grad(loss).trace(w.astype(np.float32), x.astype(np.float32)).plan
    assert "ascontiguousarray" not in generate(lower(plan)).source


def test_a_pair_that_puts_every_axis_back_goes_and_any_other_pair_stays_two_views():
    x = np.arange(24.0).reshape(2, 3, 4)
    weights = np.arange(24.0).reshape(2, 3, 4)

    def undone(x):
        return bp.sum(bp.transpose(bp.transpose(x, (1, 2, 0)), (2, 0, 1)) * weights)

    def moved(x):  # (1, 2, 0) twice is (2, 0, 1): kept as written, for later passes' patterns
        return bp.sum(
            bp.transpose(bp.transpose(x, (1, 2, 0)), (1, 2, 0)) * weights.transpose(2, 0, 1)
        )

    assert transposes(plan_lines(undone, x)) == []
    assert transposes(plan_lines(moved, x))[:2] == ["1, 2, 0", "1, 2, 0"]
    np.testing.assert_allclose(bp.value_and_grad(undone)(x)[1].numpy(), weights)
    value, grad = bp.value_and_grad(moved)(x)
    np.testing.assert_allclose(value.numpy(), (x * weights).sum())
    np.testing.assert_allclose(grad.numpy(), weights)
