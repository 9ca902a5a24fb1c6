"""A float64 operand promoting a float32 graph (tracer/float64_promotion.py): NumPy 2 makes
`f32 * (1 / np.sqrt(d))` float64, so a float32 MLP silently traces in float64; backplan warns
once, naming the op, the dtypes and the user's line, and computes what NumPy would."""

import re
import warnings

import numpy as np
import pytest

import backplan as bp
from backplan.tracer.float64_promotion import Float64PromotionWarning

W = np.linspace(-1, 1, 32, dtype=np.float32).reshape(8, 4)
X = np.linspace(-2, 2, 24, dtype=np.float32).reshape(3, 8)


def scaled(w, x):
    return bp.sum(bp.tanh(x @ (w * (1 / np.sqrt(8)))))  # np.float64: promotes


def promotions(fn, *args) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fn(*args)
    return [str(w.message) for w in seen if w.category is Float64PromotionWarning]


def test_a_float64_scalar_in_a_float32_graph_warns_once_naming_op_and_line():
    compiled = bp.compile(scaled)
    (message,) = promotions(compiled, bp.tensor(W), X)
    assert re.match(r"mul at .*test_float64_promotion.py:\d+: a float32 operand \[8, 4\]", message)
    assert "float64 one []" in message and "np.float32(...)" in message
    assert compiled(bp.tensor(W), X).dtype == np.float64  # NumPy's answer, unchanged
    np.testing.assert_allclose(
        compiled(bp.tensor(W), X).numpy(), np.tanh(X @ (W * (1 / np.sqrt(8)))).sum()
    )
    assert promotions(bp.compile(scaled), bp.tensor(W), X) == []  # once per line


def test_a_float64_argument_warns_and_eager_ops_warn_too():
    @bp.compile
    def f(w, x):
        return bp.sum(x @ w)

    (message,) = promotions(f, bp.tensor(W), X.astype(np.float64))
    assert message.startswith("matmul at ") and "float32 operand [8, 4]" in message
    (eager,) = promotions(lambda: bp.tensor(W) * np.float64(2.0))
    assert eager.startswith("mul at ")


@pytest.mark.parametrize(
    "scale", [0.5, np.float32(0.5), 1 / np.sqrt(np.float32(8))], ids=["python", "f32", "sqrt32"]
)
def test_weak_or_float32_scalars_do_not_warn(scale):
    f = bp.compile(lambda w, x: bp.sum(x @ (w * scale)))
    assert promotions(f, bp.tensor(W), X) == []
    assert f(bp.tensor(W), X).dtype == np.float32
