"""A global or closure variable a planned function reads is frozen into its plans at the trace
(tracer/frozen_reads.py): rebinding it (`scale = 3.0`, `w = new_tensor`) used to leave every
later call computing with the old object, silently. Now the next call traces again, with a
RetraceWarning naming the variable and pointing at the caller's line."""

import inspect
import warnings

import numpy as np
import pytest

import backplan as bp
from backplan.tracer.frozen_reads import frozen_reads

scale = 2.0
offset = bp.tensor([1.0, 2.0])
shape = 3  # a global that shares its name with an attribute the functions below read


def scaled(x):
    return x * scale + offset


def retrace_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, bp.RetraceWarning)]


def test_a_rebound_global_number_and_tensor_are_read_again(monkeypatch):
    f = bp.compile(scaled)
    x = bp.tensor([1.0, 1.0])
    np.testing.assert_allclose(f(x).numpy(), [3.0, 4.0])
    np.testing.assert_allclose(f(x).numpy(), [3.0, 4.0])
    assert f.cache_info().traces == 1  # unchanged variables: the cached plan runs
    monkeypatch.setitem(globals(), "scale", 5.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        got = f(x)  # the line the warning names
    np.testing.assert_allclose(got.numpy(), [6.0, 7.0])
    (message,) = retrace_warnings(caught)
    assert "the global `scale`" in message and "scaled" in message, message
    warning = [w for w in caught if issubclass(w.category, bp.RetraceWarning)][0]
    assert (warning.filename, warning.lineno) == (__file__, line)
    info = f.cache_info()
    assert info.traces == 2 and "the global `scale` was rebound" in info.last_miss_reason
    monkeypatch.setitem(globals(), "offset", bp.tensor([10.0, 20.0]))
    with pytest.warns(bp.RetraceWarning, match="the global `offset`"):
        np.testing.assert_allclose(f(x).numpy(), [15.0, 25.0])


def test_a_rebound_closure_variable_reaches_value_and_grad():
    k = 1.0
    step = bp.value_and_grad(lambda w: (w * k).sum())
    w = np.ones(3, np.float32)
    assert step(w)[0].item() == 3.0
    k = 4.0
    with pytest.warns(bp.RetraceWarning, match="the closure variable `k`"):
        loss, grad = step(w)
    assert loss.item() == 12.0
    np.testing.assert_allclose(grad.numpy(), [4.0, 4.0, 4.0])


def test_explain_traces_again_after_a_rebinding(monkeypatch):
    f = bp.compile(scaled)
    x = bp.tensor([1.0, 1.0])
    f(x)
    monkeypatch.setitem(globals(), "scale", 7.0)
    with pytest.warns(bp.RetraceWarning, match="the global `scale`"):
        f.explain(x)
    assert f.cache_info().traces == 2
    np.testing.assert_allclose(f(x).numpy(), [8.0, 9.0])  # the plan explain traced


def test_only_loaded_variables_of_watched_kinds_are_checked():
    """Attribute names (x.shape), modules and functions are not watched: a function reading
    none of the watched kinds leaves the call path nothing to check."""

    def no_variables(x):
        return bp.tanh(x).sum() * x.shape[0]

    assert frozen_reads(no_variables) is None
    reads = frozen_reads(scaled)
    assert [name for name, _ in reads.globals] == ["offset", "scale"]

    def comprehension(x):
        return [x * scale for _ in range(2)]

    assert [name for name, _ in frozen_reads(comprehension).globals] == ["scale"]


def test_a_number_rebound_to_an_equal_value_is_no_change(monkeypatch):
    """`lr = base * 0.5` each epoch makes a new float object of the same value: no retrace."""
    f = bp.compile(scaled)
    x = bp.tensor([1.0, 1.0])
    f(x)
    monkeypatch.setitem(globals(), "scale", float(np.float64(2.0)))  # a new object, equal value
    assert globals()["scale"] == 2.0
    with warnings.catch_warnings():
        warnings.simplefilter("error", bp.RetraceWarning)
        np.testing.assert_allclose(f(x).numpy(), [3.0, 4.0])
        f(x)
    assert f.cache_info().traces == 1


def test_a_trace_begun_before_a_rebinding_is_not_cached_after_it(monkeypatch):
    """Thread T traces a new signature and reads `scale` before the main thread rebinds it;
    the main thread's next call drops the cache and traces again; T's entry, which froze the
    old value, must not land in the cache after that drop (it would run silently later)."""
    import threading

    entered, gate = threading.Event(), threading.Event()

    def slow(x):
        y = x * scale
        if x.shape == (1, 3):  # the signature T traces: hold it after it read scale
            entered.set()
            gate.wait(60)
        return y

    f = bp.compile(slow)
    # another rank, not another size: a second size would make the axis dynamic, and the main
    # thread's call would wait for T's symbolic entry instead of tracing beside it
    two, three = bp.tensor([1.0, 1.0]), bp.tensor([[1.0, 1.0, 1.0]])
    f(two)
    results = {}
    thread = threading.Thread(target=lambda: results.setdefault("T", f(three).numpy()))
    thread.start()
    assert entered.wait(60)
    monkeypatch.setitem(globals(), "scale", 9.0)
    with pytest.warns(bp.RetraceWarning, match="the global `scale`"):
        np.testing.assert_allclose(f(two).numpy(), [9.0, 9.0])
    gate.set()
    thread.join(60)
    assert not thread.is_alive()
    np.testing.assert_allclose(results["T"], [[2.0, 2.0, 2.0]])  # begun before: the old value
    np.testing.assert_allclose(f(three).numpy(), [[9.0, 9.0, 9.0]])
