"""The predicted peak of a step (ir/peak.py): per category, for the compiled plans and the
reference interpreter, from the plans alone."""

from __future__ import annotations

import numpy as np
import pytest

import backplan as bp
from backplan.ir.lowering import lower
from backplan.ir.peak import joint_calls, predicted_peak, region_calls


def _mlp_step():
    w = bp.tensor(np.ones((16, 8), np.float32), requires_grad=True)
    x = bp.tensor(np.ones((32, 16), np.float32))

    @bp.compile
    def loss(x, w):
        return bp.tanh(x @ w).sum()

    return loss.trace(x, w).program.plans


def test_compiled_peak_holds_one_shared_arena_forward_outputs_and_gradients_in_the_backward():
    """The forward and the backward() consuming it draw from one arena (runtime/program.py):
    the step holds the larger plan's scratch, not the sum."""
    plans = _mlp_step()
    report = predicted_peak(region_calls(plans), "numba")
    forward, backward = plans.lowered(None), lower(plans.backward, plans.private_saved_inputs())
    arenas = [
        max((max(n, 1) * 4 for n in low.layout.scratch_elements.values()), default=0)
        for low in (forward, backward)
    ]
    assert min(arenas) > 0  # both plans have scratch: the sum would differ from the max
    at_peak = report.at_peak()
    assert report.peak_step.plan == "backward"
    assert at_peak["scratch"] == max(arenas)
    assert at_peak["inputs"] == 32 * 16 * 4 + 16 * 8 * 4  # x and w
    assert at_peak["gradients"] == 16 * 8 * 4 + 4  # w's gradient and the loss's seed
    assert at_peak["outputs"] == 4
    assert at_peak["saved"] == sum(v.type.nbytes for v in forward.layout.outputs) - 4
    assert report.peak_bytes == sum(at_peak.values())
    assert report.allocated_peak_bytes == report.peak_bytes - at_peak["inputs"]
    assert report.fits(report.peak_bytes) and not report.fits(report.peak_bytes - 1)


def test_reference_timeline_is_explains_plus_the_callers_arrays():
    w = bp.tensor(np.ones((16, 8), np.float32))
    x = bp.tensor(np.ones((32, 16), np.float32))
    f = bp.value_and_grad(lambda w, x: bp.tanh(x @ w).sum())
    report = predicted_peak(joint_calls(f.trace(w, x).plan, 1), "reference")
    held = [s.nbytes - report.input_bytes for s in report.steps]
    assert held == f.explain(w, x).live_bytes
    assert report.input_bytes == w.numpy().nbytes + x.numpy().nbytes


def test_joint_plan_gradients_are_their_own_category():
    f = bp.value_and_grad(lambda w, x: bp.tanh(x @ w).sum())
    entry = f.trace(
        bp.tensor(np.ones((16, 8), np.float32)), bp.tensor(np.ones((32, 16), np.float32))
    )
    for backend in ("numba", "reference"):
        at_end = predicted_peak(joint_calls(entry.plan, 1), backend).steps[-1].held
        assert at_end["gradients"] == 16 * 8 * 4
        assert at_end["inputs"] == (16 * 8 + 32 * 16) * 4


@pytest.mark.parametrize("bad", [-1, 2.5, True, "1GB"])
def test_fits_refuses_what_is_not_a_byte_count(bad):
    report = predicted_peak(region_calls(_mlp_step()), "numba")
    with pytest.raises(ValueError, match="byte count"):
        report.fits(bad)


def test_fits_takes_numpy_integers():
    # a byte count computed with NumPy (np.prod(shape) * 4) is an np.int64
    report = predicted_peak(region_calls(_mlp_step()), "numba")
    assert report.fits(np.int64(report.peak_bytes))
    assert not report.fits(np.int64(report.peak_bytes - 1))


def test_the_planners_peak_bytes_are_the_reports_peak_with_a_convs_workspace():
    """predicted_peak_bytes (what the memory planner weighs every plan by) is the report's peak,
    on a region step (both arenas, saved buffers), a joint plan, and a conv whose im2col
    workspace is a buffer of its arena."""
    from backplan.ir.peak import predicted_peak_bytes

    rng = np.random.default_rng(0)
    x = bp.tensor(rng.standard_normal((2, 3, 8, 8)).astype(np.float32))
    k = bp.tensor(rng.standard_normal((4, 3, 3, 3)).astype(np.float32))
    conv = bp.value_and_grad(lambda k, x: bp.tanh(bp.conv2d(x, k)).sum())
    steps = [region_calls(_mlp_step()), joint_calls(conv.trace(k, x).plan, 1)]
    for calls in steps:
        report = predicted_peak(calls, "numba")
        assert predicted_peak_bytes(calls, "numba") == report.peak_bytes
        assert (
            predicted_peak_bytes(calls, "reference")
            == predicted_peak(calls, "reference").peak_bytes
        )
    assert "workspace" not in report.peak_step.held  # the columns are the arena's
    assert lower(conv.trace(k, x).plan).layout.workspaces
