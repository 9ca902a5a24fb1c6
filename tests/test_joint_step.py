"""A small compiled loss that backward() follows runs as one joint plan after a few calls
(runtime/joint_step.py); whatever backward() then does, the gradients are the two plans'."""

import sys
import threading

import numpy as np
import pytest

import backplan as bp
from backplan.runtime.joint_step import CALLS_TO_LEARN, JointRegion

RNG = np.random.default_rng(7)
W = RNG.standard_normal((5, 3)).astype(np.float32)
B = RNG.standard_normal(3).astype(np.float32)
X = RNG.standard_normal((4, 5)).astype(np.float32)


def loss(params, x):
    return bp.tanh(x @ params["w"] + params["b"]).sum()


def expected_grads(scale=1.0):
    """d/dw and d/db of sum(tanh(x @ w + b)), in float64."""
    z = X.astype(np.float64) @ W + B
    d = (1.0 - np.tanh(z) ** 2) * scale
    return {"w": X.T.astype(np.float64) @ d, "b": d.sum(0)}


def params():
    return {"w": bp.tensor(W, requires_grad=True), "b": bp.tensor(B, requires_grad=True)}


def check(p, scale=1.0):
    for name, want in expected_grads(scale).items():
        np.testing.assert_allclose(p[name].grad.numpy(), want, rtol=1e-5, atol=1e-5)


def two_plans_step(step, p):
    """One training step that runs on two plans, its gradients checked."""
    bp.zero_grad(p)
    out = step(p, X)
    assert not isinstance(out.grad_fn, JointRegion)
    out.backward()
    check(p)


def learned(step, p):
    """Call step like a training loop until it runs the joint plan; each step's grads checked."""
    for _ in range(CALLS_TO_LEARN):
        two_plans_step(step, p)
    bp.zero_grad(p)
    return step(p, X)


def test_a_training_loop_runs_the_joint_plan_with_the_same_gradients():
    step, p = bp.compile(loss), params()
    out = learned(step, p)
    assert isinstance(out.grad_fn, JointRegion)
    z = X.astype(np.float64) @ W + B
    np.testing.assert_allclose(out.item(), np.tanh(z).sum(), rtol=1e-5)
    out.backward()
    check(p)
    for _ in range(3):  # it stays on, and .grad accumulates without zero_grad
        step(p, X).backward()
    check(p, scale=4.0)
    assert isinstance(step(p, X).grad_fn, JointRegion)


def test_another_seed_recomputes_the_saved_buffers_and_starts_learning_again():
    step, p = bp.compile(loss), params()
    out = learned(step, p)
    (out * 2.0).backward()  # the loss is not the root: its cotangent is 2
    check(p, scale=2.0)
    out = learned(step, p)  # two plans again for CALLS_TO_LEARN calls, then one
    assert isinstance(out.grad_fn, JointRegion)
    out.backward()
    check(p)


def test_retain_graph_then_a_consuming_backward_and_then_the_freed_error():
    step, p = bp.compile(loss), params()
    out = learned(step, p)
    out.backward(retain_graph=True)
    out.backward()
    check(p, scale=2.0)
    with pytest.raises(bp.GraphFreedError, match="already freed"):
        out.backward()


def test_a_second_backward_says_freed_as_the_two_plans_do():
    step, p = bp.compile(loss), params()
    out = learned(step, p)
    out.backward()
    with pytest.raises(bp.GraphFreedError, match="already freed") as joint:
        out.backward()
    q = params()
    plain = bp.compile(loss)(q, X)
    plain.backward()
    with pytest.raises(bp.GraphFreedError, match="already freed") as split:
        plain.backward()
    assert str(joint.value).split(" at ")[0] == str(split.value).split(" at ")[0]


def _second_backward_message(out) -> str:
    out.backward()
    with pytest.raises(bp.GraphFreedError) as caught:
        out.backward()
    return str(caught.value)


def test_the_freed_message_of_a_joint_call_is_the_two_plans_one_word_for_word():
    """The joint call's backward() marks its region freed itself (FreedBy without a reference
    to the root it is held by): the message still names both lines and says 'the same graph'."""
    trained, p = bp.compile(loss), params()
    learned(trained, p).backward()  # a joint call backward()ed: the next is joint too
    messages = []
    for step in (trained, bp.compile(loss)):  # the joint plan, then a first call: two plans
        bp.zero_grad(p)
        out = step(p, X)
        messages.append(_second_backward_message(out))
        assert isinstance(out.grad_fn, JointRegion) == (step is trained)
    assert messages[0] == messages[1]
    assert "same graph" in messages[0] and messages[0].count("test_joint_step.py:") >= 4


def test_an_evaluation_call_between_training_steps_sends_the_next_to_two_plans():
    step, p = bp.compile(loss), params()
    learned(step, p)  # an evaluation call: its gradients are never read
    two_plans_step(step, p)
    bp.zero_grad(p)
    step(p, X)  # a split call whose loss is not backward()ed either
    assert isinstance(learned(step, p).grad_fn, JointRegion)


def test_an_input_from_an_earlier_op_gets_its_gradient_routed_upstream():
    step = bp.compile(loss)
    w0 = bp.tensor(W / 2, requires_grad=True)
    b = bp.tensor(B, requires_grad=True)
    for _ in range(CALLS_TO_LEARN + 2):
        w0.grad = b.grad = None
        out = step({"w": w0 * 2.0, "b": b}, X)
        out.backward()
        want = expected_grads()
        np.testing.assert_allclose(w0.grad.numpy(), 2 * want["w"], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(b.grad.numpy(), want["b"], rtol=1e-5, atol=1e-5)
    assert isinstance(out.grad_fn, JointRegion)


def test_one_tensor_passed_twice_gets_both_gradients():
    def twice(a, b, x):
        return (x @ a * (x @ b)).sum()

    step = bp.compile(twice)
    w = bp.tensor(W, requires_grad=True)
    xw = X.astype(np.float64) @ W
    for _ in range(CALLS_TO_LEARN + 1):
        w.grad = None
        out = step(w, w, X)
        out.backward()
        np.testing.assert_allclose(w.grad.numpy(), 2 * X.T @ xw, rtol=1e-5, atol=1e-4)
    assert isinstance(out.grad_fn, JointRegion)


def test_switched_off_by_the_variable_and_for_large_steps(monkeypatch):
    monkeypatch.setenv("BACKPLAN_JOINT_STEP", "0")
    step, p = bp.compile(loss), params()
    learned(step, p).backward()
    assert not isinstance(step(p, X).grad_fn, JointRegion)
    monkeypatch.delenv("BACKPLAN_JOINT_STEP")

    def large(w, x):
        return (x @ w).sum()

    big = bp.compile(large)
    wb = bp.tensor(np.ones((512, 512), np.float32), requires_grad=True)
    xb = np.ones((64, 512), np.float32)  # 2 x 16.8 MFLOP forward alone
    for _ in range(CALLS_TO_LEARN + 1):
        out = big(wb, xb)
        out.backward()
    assert not isinstance(out.grad_fn, JointRegion)


def test_two_threads_training_apart_each_get_their_own_gradients():
    step = bp.compile(loss)
    errors = []

    def train(scale):
        try:
            p = {"w": bp.tensor(W * scale, requires_grad=True), "b": bp.tensor(B)}
            for _ in range(20):
                p["w"].grad = None
                step(p, X).backward()
                z = X.astype(np.float64) @ (W * scale) + B
                want = X.T @ (1.0 - np.tanh(z) ** 2)
                np.testing.assert_allclose(p["w"].grad.numpy(), want, rtol=1e-4, atol=1e-5)
        except BaseException as exc:  # noqa: BLE001  (reported by the main thread)
            errors.append(exc)

    threads = [threading.Thread(target=train, args=(s,)) for s in (1.0, 0.5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_two_threads_backward_of_one_joint_loss_hand_the_gradients_over_once():
    """Both threads call backward() on one joint call's loss at once, the switch interval at
    its smallest: one hands the gradients over, the other raises GraphFreedError naming the
    first one's line, and every gradient is one step's (not two, not none)."""
    step, p = bp.compile(loss), params()
    learned(step, p).backward()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(60):
            bp.zero_grad(p)
            out = step(p, X)
            assert isinstance(out.grad_fn, JointRegion)
            start, outcomes = threading.Barrier(2), []

            def run(out=out, start=start, outcomes=outcomes):
                start.wait()
                try:
                    out.backward()
                    outcomes.append("handed")
                except bp.GraphFreedError as exc:
                    outcomes.append(str(exc))

            threads = [threading.Thread(target=run) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert sorted(outcomes)[-1] == "handed" and outcomes.count("handed") == 1, outcomes
            assert "the backward() at test_joint_step.py:" in sorted(outcomes)[0]
            check(p)
    finally:
        sys.setswitchinterval(interval)


def test_parameters_the_function_captures_get_their_gradients():
    w, b = bp.tensor(W, requires_grad=True), bp.tensor(B, requires_grad=True)

    @bp.compile
    def captured(x):
        return bp.tanh(x @ w + b).sum()

    for _ in range(CALLS_TO_LEARN + 2):
        w.grad = b.grad = None
        out = captured(X)
        out.backward()
        check({"w": w, "b": b})
    assert isinstance(out.grad_fn, JointRegion)


def test_print_grad_fn_of_a_joint_call_says_not_held_not_freed_before_backward():
    """The quickstart's print(loss.grad_fn) in a training loop: from the third call the
    buffers were never held, and no backward() has freed them yet."""
    step, p = bp.compile(loss), params()
    out = learned(step, p)
    table = str(out.grad_fn)
    rows = [line for line in table.splitlines() if "derivative reads" in line]
    assert rows and all(line.endswith("not held (joint plan)") for line in rows)
    assert "freed" not in table and "one plan" in table
    graph = str(out.graph())
    assert "not held (joint plan)" in graph and " freed" not in graph
    out.backward()
    check(p)
    rows = [line for line in str(out.grad_fn).splitlines() if "derivative reads" in line]
    assert rows and all(line.endswith("freed") for line in rows)


def test_explain_says_when_the_step_may_run_as_one_plan(monkeypatch):
    p = params()
    said = " ".join(str(bp.compile(loss).explain(p, X)).split())
    assert "a call runs as one joint plan instead (as value_and_grad" in said
    monkeypatch.setenv("BACKPLAN_JOINT_STEP", "0")
    assert "one joint plan" not in str(bp.compile(loss).explain(p, X))
