"""A long plan driver is split into compiled parts (codegen/driver_split.py): the parts pass on
exactly the names later parts read, the split plan computes what the reference does, and a slow
first call says when each part is compiled."""

import numpy as np

import backplan as bp
from backplan.codegen import driver_split
from backplan.runtime.backend import use_backend


def _run(source: str, *args):
    scope = {}
    exec(source, scope)
    return scope["run"](*args)


def test_parts_pass_on_what_later_parts_read():
    body = [
        "# a comment above the first statement",
        "a = x + 1",
        "b = a * 2",
        "bad = -1 if b > 0 else 3",
        "if bad != -1:",
        "    raise IndexError('never')",
        "c = a + b",
        "d = c - x",
        "a = d * 10",
        "return (a, b, d)",
    ]
    whole = driver_split.driver_source(["x"], body, "")
    assert whole.parts == 0 and whole.statements == 8
    original = driver_split.PART_STATEMENTS, driver_split.SPLIT_ABOVE
    try:
        driver_split.SPLIT_ABOVE = 0
        for size in (1, 2, 3):
            driver_split.PART_STATEMENTS = size
            split = driver_split.driver_source(["x"], body, "")
            assert split.parts == -(-8 // size) and "run_part0" in split.source
            assert _run(split.source, 5) == _run(whole.source, 5) == (130, 12, 13)
    finally:
        driver_split.PART_STATEMENTS, driver_split.SPLIT_ABOVE = original


def rnn(u, xs):
    h = bp.tanh(xs[0])
    for t in range(1, xs.shape[0]):
        h = bp.tanh(xs[t] + h @ u)
    return bp.sum(h * h)


def test_a_split_driver_matches_the_reference_and_reports_its_parts(monkeypatch, capfd):
    monkeypatch.setattr(driver_split, "PART_STATEMENTS", 5)
    monkeypatch.setattr(driver_split, "SPLIT_ABOVE", 0)
    monkeypatch.setenv("BACKPLAN_PROGRESS_SECONDS", "0")
    rng = np.random.default_rng(3)
    u = bp.tensor(rng.standard_normal((5, 5)).astype(np.float32))
    xs = bp.tensor(rng.standard_normal((3, 2, 5)).astype(np.float32))
    capfd.readouterr()
    with use_backend("numba"):
        vg = bp.value_and_grad(rnn)
        value, grad = vg(u, xs)
        compiled = vg.trace(u, xs).runner().compiled
    err = capfd.readouterr().err
    assert "def run_part1(" in compiled.source
    if not compiled.cache_hit:
        assert "driver part 1/" in err
    with use_backend("reference"):
        expected_value, expected_grad = bp.value_and_grad(rnn)(u, xs)
    np.testing.assert_allclose(value.numpy(), expected_value.numpy(), rtol=1e-5)
    np.testing.assert_allclose(grad.numpy(), expected_grad.numpy(), rtol=1e-5, atol=1e-6)
