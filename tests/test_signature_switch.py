"""A function called with two static signatures in turn (here float32 and float64 arguments)
keeps each signature's compiled plans; a call of one held the other's scratch arenas too,
beyond the peak explain() prints for its signature. A call that switches signature now frees
the other signatures' idle arenas first, so every call holds what explain prints for it."""

from __future__ import annotations

import numpy as np
import pytest

import backplan as bp
from backplan.codegen.run.memory_check import checked_memory, measure
from backplan.runtime.backend import use_backend


def loss(w, x):
    return bp.mean(bp.tanh(x @ w) * x.sum())


def arguments(dtype, rng):
    w = bp.tensor(rng.standard_normal((5, 7)).astype(dtype), requires_grad=True)
    x = bp.tensor(rng.standard_normal((6, 5)).astype(dtype))
    return w, x


@pytest.mark.parametrize("backend", ["numba", "reference"])
@pytest.mark.parametrize("kind", ["value_and_grad", "compile"])
def test_calls_alternating_signatures_hold_what_explain_prints_for_each(backend, kind):
    rng = np.random.default_rng(3)
    signatures = {"f32": arguments(np.float32, rng), "f64": arguments(np.float64, rng)}
    compiled = bp.compile(loss)
    if kind == "value_and_grad":
        step = run = bp.value_and_grad(compiled)
    else:
        step = compiled

        def run(w, x):
            for other, _ in signatures.values():  # the gradients of both are the caller's
                other.grad = None
            compiled(w, x).backward()

    order = ["f32", "f64", "f32", "f64", "f64", "f32", "f32", "f32", "f64"]
    counted, printed, calls = [], [], {}
    with use_backend(backend), checked_memory(), measure() as held:
        for name in order:
            held.restart_at_next_use()  # what earlier calls left alive counts while held
            run(*signatures[name])
            counted.append(held.peak)
            calls[name] = calls.get(name, 0) + 1
            report = step.explain(*signatures[name])
            printed.append(report.peak_on_call(calls[name]).allocated_peak_bytes)
    assert step.cache_info().entries == 2  # two static signatures, no dynamic axis
    assert len(set(printed)) > 1  # the signatures' peaks differ
    assert counted == printed
