"""A later size of a symbolic plan keeps no lowering once its runner exists (ir/lowering.py
let_go): its runner holds what it runs, the first size keeps its lowering, and explain lowers
a later size again to the same plan: its peak is the checked mode's count of the call, and the
values are the reference interpreter's, on value_and_grad and on compile + backward()."""

import numpy as np
import pytest

import backplan as bp
from backplan.codegen.run.memory_check import checked_memory, measure
from backplan.runtime.backend import use_backend
from backplan.tracer.dynamic import DynamicEntry

RNG = np.random.default_rng(11)
W = bp.tensor(RNG.standard_normal((5, 7)).astype(np.float32), requires_grad=True)


def loss(w, x):  # test_dynamic's alternating-sizes model: its plans' kernels and drivers shared
    return bp.mean(bp.tanh(x @ w) * x.sum())


def entry_of(fn) -> DynamicEntry:
    (entry,) = [e for e in fn._entries.values() if isinstance(e, DynamicEntry)]
    return entry


def size_plans(fn, n) -> list:
    """The plans a size's entry runs: value_and_grad's joint plan, or compile's forward and
    backward."""
    entry = entry_of(fn).at(n, None)
    program = getattr(entry, "program", None)
    return [entry.plan] if program is None else list(program.plans.named.values())


@pytest.mark.parametrize(
    "kind,sizes",  # compile's explain at a symbolic size takes ~1 s: fewer calls
    [("value_and_grad", (4, 6, 9, 6)), ("compile", (4, 9, 9))],
)
def test_a_later_size_lets_its_lowering_go_and_explain_lowers_it_again_to_the_same_peak(
    kind, sizes
):
    compiled = bp.compile(loss, dynamic={"x": {0: "n"}})
    if kind == "value_and_grad":
        step = run = bp.value_and_grad(compiled)
    else:
        step = compiled

        def run(w, x):
            w.grad = None
            compiled(w, x).backward()

    xs = {n: bp.tensor(RNG.standard_normal((n, 5)).astype(np.float32)) for n in (4, 6, 9)}
    counted, printed, calls = [], [], {}
    with use_backend("numba"), checked_memory(), measure() as held:
        for n in sizes:
            held.restart_at_next_use()  # what earlier calls left alive counts while held
            run(W, xs[n])
            counted.append(held.peak)
            calls[n] = calls.get(n, 0) + 1
            if n != 4 and calls[n] == 1:  # (explain's lowering stays: it asked for one)
                assert all(not p.lowered for p in size_plans(step, n)), n
            report = step.explain(W, xs[n])
            printed.append(report.peak_on_call(calls[n]).allocated_peak_bytes)
    assert all(p.lowered for p in size_plans(step, 4))  # the first size keeps its own
    assert counted == printed
    assert len(set(counted)) == len(set(sizes))


@pytest.mark.parametrize("n", [6, 9])
def test_a_later_size_gives_the_reference_values_after_explain_lowered_it_again(n):
    step = bp.value_and_grad(bp.compile(loss, dynamic={"x": {0: "n"}}))
    x = bp.tensor(RNG.standard_normal((n, 5)).astype(np.float32))
    with use_backend("numba"):
        step(W, bp.tensor(RNG.standard_normal((4, 5)).astype(np.float32)))
        step(W, x)
        step.explain(W, x)
        value, grad = step(W, x)
    with use_backend("reference"):
        expected, expected_grad = bp.value_and_grad(loss)(W, x)
    np.testing.assert_allclose(value.numpy(), expected.numpy(), rtol=1e-5)
    np.testing.assert_allclose(grad.numpy(), expected_grad.numpy(), rtol=1e-4, atol=1e-6)
