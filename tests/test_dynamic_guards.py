"""Python ints computed from a dynamic size (tracer/traced_size.py): a slice bound, a reshape,
a loop count or a branch that agrees at every traced size and differs at another never gives
a wrong result there (that size is traced on its own), and size reads that are formulas of the
size keep one plan for every size."""

import re

import numpy as np
import pytest

import backplan as bp
from backplan.artifacts.format import ExportError


def sliced(x):
    return x[: x.shape[0] // 4 * 4] * 2.0


def halves(x):
    n = x.shape[0]
    return bp.sum(x[: n // 2 * 2].reshape(n // 2, 4), axis=1)


def looped(x):
    y = x
    for _ in range(x.shape[0] // 8):
        y = y * 2.0
    return y


def branched(x):
    if x.shape[0] > 8:
        return x * 2.0
    return x * 3.0


def capped(x):
    return x[: min(x.shape[0], 100)] * 2.0


def of_intermediate(x):
    h = bp.tanh(x)
    if h.shape[0] % 2 == 0:
        return h + 1.0
    return h - 1.0


def by_len(x):
    return x * 2.0 if len(x) > 8 else x * 3.0


def by_size_method(x):
    return x * 2.0 if x.size(0) >= 9 else x * 3.0


CASES = [sliced, halves, looped, branched, capped, of_intermediate, by_len, by_size_method]


def rows(n: int):
    return bp.tensor(np.arange(2 * n, dtype=np.float32).reshape(n, 2) / 7.0)


def each_size_alone(fn, x):
    return bp.compile(fn, dynamic=False)(x).numpy()


@pytest.mark.parametrize("fn", CASES, ids=lambda f: f.__name__)
@pytest.mark.parametrize("declared", [False, True], ids=["automatic", "declared"])
def test_a_size_the_users_code_decides_on_never_gives_a_wrong_result(fn, declared):
    compiled = bp.compile(fn, dynamic={"x": {0: "n"}} if declared else None)
    for n in (16, 32, 9, 5, 200, 150, 7, 33, 40):
        got, want = compiled(rows(n)).numpy(), each_size_alone(fn, rows(n))
        assert got.shape == want.shape, (fn.__name__, n)
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_a_branch_every_traced_size_takes_keeps_one_plan_where_it_holds():
    compiled = bp.compile(branched, dynamic={"x": {0: "n"}})
    for n in (16, 40, 100, 9):
        np.testing.assert_allclose(compiled(rows(n)).numpy(), rows(n).numpy() * 2.0)
    assert compiled.cache_info().traces == 1  # traced at 16 (probes 32, 48, 33): all > 8
    np.testing.assert_allclose(compiled(rows(5)).numpy(), rows(5).numpy() * 3.0)
    assert compiled.cache_info().traces == 2  # 5 > 8 is False: 5 traced on its own


def test_sizes_read_as_formulas_keep_one_plan():
    def model(w, x):
        n, d = x.shape
        h = bp.tanh(x.reshape(n, d) @ w)
        return bp.mean(h.reshape(h.shape[0] * 2, -1)) + float(d)

    w = bp.tensor(np.ones((4, 6), np.float32) / 10)
    compiled = bp.compile(model, dynamic={"x": {0: "n"}})
    for n in (8, 13, 50):
        x = bp.tensor(np.linspace(-1, 1, 4 * n, dtype=np.float32).reshape(n, 4))
        np.testing.assert_allclose(compiled(w, x).numpy(), model(w, x).numpy(), rtol=1e-5)
    assert compiled.cache_info().traces == 1


def test_a_size_decision_refuses_a_dynamic_export_naming_the_line(tmp_path):
    compiled = bp.compile(branched)
    with pytest.raises(ExportError, match=r"size > 8 at .*test_dynamic_guards.py:\d+"):
        bp.export(compiled, rows(16), path=tmp_path / "b.bpz", dynamic={"x": {0: "n"}})


def halved_then_compared(x):
    return x * 2.0 if x.shape[0] / 2 > 4 else x * 3.0


def as_float(x):
    return x * 2.0 if float(x.shape[0]) > 8 else x * 3.0


def scaled_by_float(x):
    return x * 2.0 if x.shape[0] * 0.5 > 4 else x * 3.0


def by_bit_length(x):
    return x * 2.0 if x.shape[0].bit_length() > 4 else x * 3.0


def rounded_to_tens(x):
    return x * 2.0 if round(x.shape[0], -1) > 10 else x * 3.0


@pytest.mark.parametrize(
    "fn",
    [halved_then_compared, as_float, scaled_by_float, by_bit_length, rounded_to_tens],
    ids=lambda f: f.__name__,
)
def test_a_size_turned_into_a_float_or_bit_count_never_gives_a_wrong_result(fn):
    """n / 2, float(n), n * 0.5 and n.bit_length() leave the int: the branch on them is
    decided at every traced size (16, 32, 48, 33) alike, and differently at 6."""
    compiled = bp.compile(fn, dynamic={"x": {0: "n"}})
    for n in (16, 6, 40, 5):
        np.testing.assert_allclose(compiled(rows(n)).numpy(), each_size_alone(fn, rows(n)))


@pytest.mark.parametrize("declared", [False, True], ids=["automatic", "declared"])
def test_a_size_returned_as_a_python_value_is_each_calls_own(declared):
    compiled = bp.compile(
        lambda x: (bp.sum(x), x.shape[0], x.shape[0] > 8),
        dynamic={"x": {0: "n"}} if declared else None,
    )
    for n in (16, 32, 5, 40, 33):
        total, size, large = compiled(rows(n))
        assert (size, large) == (n, n > 8) and type(size) is int  # not the traced size's
        np.testing.assert_allclose(total.numpy(), rows(n).numpy().sum(), rtol=1e-6)


def test_explain_says_which_sizes_decide_apart_from_the_one_plan():
    compiled = bp.compile(branched, dynamic={"x": {0: "n"}})
    for n in (16, 40, 5):
        compiled(rows(n))
    at_five = compiled.explain(rows(5)).dynamic
    assert at_five.startswith("Dynamic axis n: at n=5 the function decides otherwise")
    assert re.search(r"size > 8 is False at .*test_dynamic_guards.py:\d+", at_five)
    at_forty = compiled.explain(rows(40)).dynamic
    assert "one plan for every size" in at_forty and "Size 5 runs a plan of its own" in at_forty


def test_the_retrace_reason_of_a_size_traced_by_a_guard_names_the_guard():
    """cache_info and explain's 'The last retrace happened because' said 'first call' for the
    second trace, made because the code decides otherwise at that size."""
    compiled = bp.compile(branched, dynamic={"x": {0: "n"}})
    compiled(rows(16))
    compiled(rows(5))
    info = compiled.cache_info()
    assert info.traces == 2
    assert "n=5" in info.last_miss_reason and "size > 8" in info.last_miss_reason
