"""explain's why-saved column names the derivative rule that reads each saved buffer, also for
a value the plan recomputes late in the gradient part: a float64 tanh cast to float32 before a
matmul is saved as the cast (the matmul's weight gradient reads it), and a copy of that cast
once read as a saved_dtype copy of the tanh ('tanh derivative reads its output, kept in f32
(saved_dtype)') although no saved_dtype was asked for. Nothing here compiles (explain only)."""

from __future__ import annotations

import numpy as np

import backplan as bp


def _loss(p, x):
    h = bp.tanh(x @ p["w1"])
    return bp.sum(h.astype(bp.float32) @ p["w2"])


def _args(requires_grad=False):
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((8, 16))
    w2 = rng.standard_normal((16, 4)).astype(np.float32)
    p = {"w1": bp.tensor(w1, requires_grad=requires_grad)}
    p["w2"] = bp.tensor(w2, requires_grad=requires_grad)
    return p, rng.standard_normal((5, 8))


def test_a_recomputed_cast_is_saved_for_the_matmul_that_reads_it():
    report = bp.value_and_grad(_loss).explain(*_args())
    casts = [b for b in report.saved_buffers if b.op == "astype"]
    assert [(b.dtype, b.shape) for b in casts] == [(np.dtype(np.float32), (5, 16))]
    assert casts[0].reason == "matmul derivative reads input 0"
    assert "saved_dtype" not in str(report)


def test_a_compiled_loss_names_the_same_reason():
    p, x = _args(requires_grad=True)
    report = bp.compile(_loss).explain(p, x)
    reasons = {b.reason for b in report.saved_buffers if b.op == "astype"}
    assert reasons <= {"matmul derivative reads input 0"}
    assert "saved_dtype" not in str(report)


def test_a_saved_dtype_copy_still_says_so():
    report = bp.value_and_grad(_loss, saved_dtype=bp.bfloat16).explain(*_args())
    assert any("(saved_dtype)" in b.reason for b in report.saved_buffers)
