"""Both forms the pipeline builds (a region's two plans, value_and_grad's joint plan) answer the
same members (ir/plans.py StepPlans), so peak, budgets and explain read either without asking
which it is."""

import numpy as np

import backplan as bp
from backplan.ir.peak import predicted_peak
from backplan.ir.plans import JointPlans, RegionPlans
from backplan.report.loop_peak import holding
from backplan.tracer.budget import step_peak_bytes

W = np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3)
X = np.linspace(0, 2, 8, dtype=np.float32).reshape(2, 4)


def loss(w, x):
    return bp.tanh(x @ w).sum()


def builds():
    w = bp.tensor(W, requires_grad=True)
    region = bp.compile(loss).trace(w, X).planner.build()
    joint = bp.value_and_grad(loss).trace(w, X).planner.build()
    return region, joint


def test_each_form_names_the_plans_its_step_runs():
    region, joint = builds()
    assert isinstance(region, RegionPlans) and isinstance(joint, JointPlans)
    assert region.named == {"forward": region.forward, "backward": region.backward}
    assert joint.named == {"joint": joint.plan}
    assert [c.label for c in region.peak_calls()] == ["forward", "backward"]
    assert [c.label for c in joint.peak_calls()] == ["joint"]


def test_saved_bytes_are_what_the_region_holds_and_nothing_for_the_joint_plan():
    region, joint = builds()
    # tanh's output (2x3 float32) is saved for the backward; w and x are the caller's arrays
    assert region.saved_bytes == 2 * 3 * 4
    assert joint.saved_bytes == 0
    held = region.held_forward_values()
    assert {v.op for v in held.values()} >= {"tanh"}
    assert joint.held_forward_values() == {}


def test_one_peak_function_for_both_forms():
    """(The suite runs on the reference backend, whose accounting step_peak_bytes takes.)
    Both in the loop users write: the joint plan's loss and gradients (4 + w's 48 B) are
    bound while the next call runs; the region's loss while its forward runs."""
    region, joint = builds()
    for plans, kept in ((region, 4), (joint, 4 + 4 * 3 * 4)):
        predicted = holding(predicted_peak(plans.peak_calls(), "reference"), kept).peak_bytes
        assert step_peak_bytes(plans) == predicted > 0
