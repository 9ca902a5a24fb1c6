"""explain's kernel hashes come from the lowered plan's one rendering (report/compiled.py):
the reference backend renders nothing; the numba backend renders each plan once, and a second
explain, or the compiled plan made later, reads that rendering again."""

import numpy as np

import backplan as bp
import backplan.codegen.render.emit as emit
from backplan.ir.lowering import lower
from backplan.runtime.backend import use_backend

X = np.ones((2, 4), np.float32)


def loss(w, x):
    return bp.tanh(x @ w).sum()


def explained(monkeypatch, backend: str):
    """(step, w, every lowered plan rendered, the two reports of two explains)."""
    rendered = []
    real = emit._generate

    def counting(lowered, comments=True):
        rendered.append(lowered)
        return real(lowered, comments)

    monkeypatch.setattr(emit, "_generate", counting)
    w = bp.tensor(np.ones((4, 3), np.float32), requires_grad=True)
    step = bp.compile(loss)
    with use_backend(backend):
        reports = [step.explain(w, X), step.explain(w, X)]
    return step, w, rendered, reports


def test_the_reference_backend_renders_nothing(monkeypatch):
    _, _, rendered, (report, _) = explained(monkeypatch, "reference")
    assert rendered == [] and report.compiled is None


def test_numba_renders_each_plan_once_and_keeps_it_with_the_lowered_plan(monkeypatch):
    step, w, rendered, (first, again) = explained(monkeypatch, "numba")
    plans = step.trace(w, X).program.plans
    lowered = {
        "forward": lower(plans.forward),
        "backward (consume)": lower(plans.backward, plans.private_saved_inputs()),
        "backward (retain)": lower(plans.backward),
    }
    assert sorted(map(id, rendered)) == sorted(map(id, lowered.values()))  # once each
    for report in (first, again):
        for facts in report.compiled:
            kernels = lowered[facts.plan].rendered.loop_kernels
            assert facts.loop_kernels == tuple(k.digest for k in kernels)
