"""A long plan driver is split into compiled parts (codegen/render/driver_split.py): the parts pass
on
exactly the names later parts read, the split plan computes what the reference does, and a slow
first call says when each part is compiled."""

import ast

import numpy as np
import pytest

import backplan as bp
from backplan.codegen.render import driver_split
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


def test_a_split_driver_matches_the_reference_and_reports_its_parts(
    compiled_driver, monkeypatch, capfd
):
    monkeypatch.setattr(driver_split, "PART_STATEMENTS", 5)
    monkeypatch.setattr(driver_split, "SPLIT_ABOVE", 0)
    monkeypatch.setenv("BACKPLAN_PROGRESS_SECONDS", "0")
    monkeypatch.setenv("BACKPLAN_VERBOSE", "1")  # each part's line; a default run says one line
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


_STATEMENTS = [
    "k_ab12(scratch_f32, np.intp(1072), v3, np.float32(1.5e-05), v1_1d)",
    "v4 = scratch_f32[128:192].reshape((8, 8))",
    "v9_1d = v9.reshape(-1)",
    "(v2, v7, ) = run_part3(v1, scratch_f32, True, None)",
    "v5 = v4[0:8:1, 2:4:1].transpose((1, 0))",
    "own_gemm_at(512, False, False, np.intp(8), v3, np.intp(768), v0, np.intp(0))",
    "return (v2, v7)",
    "return v2",
    "bad = one_hot(v1, v2, 10)",
    "v3 = v2 if v1 else v0",
    "v3 = f(v2, axis=v1)",
    "v3 = g('v8')",
    "v3 = [v4 for v4 in v5]",
    "v3[v1] = v2",
    "v3 = v4 = h(v1)",
    "v3 = v1; v4 = v3",
    "h(v1)  # v9 in a comment",
    "v3 = lambda v1: v1 + v2",
    "v3 += v1",
    "v3 = v1 == v2",
]


@pytest.mark.parametrize("line", _STATEMENTS)
def test_names_read_off_the_text_are_the_syntax_trees(line):
    """The fast reading of a statement's names gives the syntax tree's names, or declines."""
    source = line if not line.startswith("return") else f"def f():\n    {line}"
    node = ast.parse(source).body[0]
    if isinstance(node, ast.FunctionDef):
        node = node.body[0]
        node.col_offset = 0
    fast = driver_split._simple_names(line, node)
    if fast is not None:
        assert fast == driver_split._names(node)


def test_the_text_reading_declines_what_it_cannot_read():
    declined = [
        s
        for s in _STATEMENTS
        if driver_split._simple_names(s, ast.parse(s).body[0]) is None
        and not s.startswith("return")
    ]
    assert declined == _STATEMENTS[9:]


def test_a_short_driver_counts_its_statements_without_parsing_them(monkeypatch):
    """Counted off first lines (a warm first call parses nothing), the count is the parsed one:
    comments, a block's body and a call's continuation lines are not statements."""
    body = [
        "# f0 = matmul(...)  (its IR line)",
        "a = k_1(x, np.intp(3))",
        "",
        "for i in range(2):",
        "    a = k_2(a,",
        "            i)",
        "b = k_3(",
        "    a, x",
        ")",
        "return (a, b)",
    ]
    parsed = len(driver_split._statements(body))
    monkeypatch.setattr(driver_split, "_statements", lambda body: pytest.fail("parsed"))
    assert driver_split.driver_source(["x"], body, "").statements == parsed == 4
    monkeypatch.undo()
    two = driver_split.driver_source(["x"], ["a = x; b = a", "return (b,)"], "")
    assert two.statements == 3  # a `;` line is parsed: two statements


def test_a_plan_that_runs_no_kernel_gets_a_driver_that_does_nothing():
    """Outputs that are all literals and views (zeros_like; the gradient through argmax, a
    literal zero) leave the driver's body empty: its module failed to compile with an
    IndentationError at the first call."""
    zeros_and_views = bp.compile(lambda x: (bp.zeros_like(x), x[1:], x.T))
    through_argmax = bp.compile(bp.grad(lambda x: bp.sum(bp.argmax(x, 1).astype(bp.float32))))
    assert driver_split.driver_source(["x"], [], "").source.rstrip().endswith("pass")
    x = np.arange(48, dtype=np.float32).reshape(8, 6)
    with use_backend("numba"):
        for _ in range(3):  # the first calls and the driver that later calls run
            zeros, tail, transposed = zeros_and_views(x)
            np.testing.assert_array_equal(zeros.numpy(), np.zeros((8, 6), np.float32))
            np.testing.assert_array_equal(tail.numpy(), x[1:])
            np.testing.assert_array_equal(transposed.numpy(), x.T)
            np.testing.assert_array_equal(through_argmax(x).numpy(), np.zeros((8, 6)))
