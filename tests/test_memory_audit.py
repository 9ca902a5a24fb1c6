"""bench.memory_audit: explain's printed peak, its bytes per category at the peak and its saved
bytes equal the step's accounting and the checked mode's measurement, for a bench model's
steps and the README's training step (small sizes; the bench runs every model)."""

from __future__ import annotations

import pytest

from backplan.bench.memory_audit import audit, model_step, readme_step
from backplan.runtime.backend import use_backend

CASES = {
    "mlp_tiny vg": lambda: model_step("mlp_tiny", "vg"),
    "mlp_tiny train": lambda: model_step("mlp_tiny", "train"),
    "README train_step": readme_step,
}


@pytest.mark.parametrize("backend", ["reference", "numba"])
@pytest.mark.parametrize("label", list(CASES))
def test_what_explain_prints_is_what_the_step_holds(label, backend):
    with use_backend(backend):
        row, problems = audit(label, CASES[label])
    assert problems == [], row
    assert row.endswith("| equal |")
