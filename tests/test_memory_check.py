"""The checked mode (BACKPLAN_CHECK_MEMORY=1): every compiled call's buffers are counted and
must equal its plan's prediction to the byte, and a step's measured peak equals the predicted
peak (ir/peak.py) less the caller's arrays. On the reference interpreter every buffer NumPy
allocates for a step (a view's base, once) is counted the same way. Runs over every op sample
(the batches test_codegen.py compiles, so the kernels are cached) and every bench model at its
small size, on both backends, as value_and_grad steps and as training steps with adam."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import counted_in_a_loop
from test_codegen import batch_graph, sample_batches

import backplan as bp
from backplan.bench.models import MODELS
from backplan.bench.peers.backplan_peer import bench_function
from backplan.codegen.run.compiled import CompiledPlan
from backplan.codegen.run.memory_check import MemoryCheckError, checked_memory, measure
from backplan.ir.lowering import lower
from backplan.ir.peak import joint_calls, predicted_peak, region_calls
from backplan.ir.pipeline import build_joint_plan
from backplan.runtime.backend import ReferenceRunner, use_backend


@pytest.fixture(autouse=True, params=["numba", "reference"])
def backend(request):
    with use_backend(request.param), checked_memory():
        yield request.param


def _measured(step):
    """The step's measured peak, on its second call (the first compiles)."""
    step()
    with measure() as measured:
        step()
    return measured


@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_every_op_sample_holds_what_its_joint_plan_predicts(dtype, backend):
    """Numba's half runs in test_codegen.py's per-batch test, where the plans are compiled."""
    if backend == "numba":
        pytest.skip("checked per batch by test_codegen.py (its plans are loaded there)")
    for samples in sample_batches(dtype):
        graph, arrays, wrt = batch_graph(samples, dtype)
        plan = build_joint_plan(graph, wrt)
        run = CompiledPlan(lower(plan)) if backend == "numba" else ReferenceRunner(plan)
        measured = _measured(lambda: run(list(arrays)))  # noqa: B023 - called here
        predicted = predicted_peak(joint_calls(plan, 1 + len(samples)), backend)
        assert measured.peak == predicted.allocated_peak_bytes, [s.id for s in samples]


def _model(name):
    spec = MODELS[name]
    inputs = spec.inputs(small=True, dtype=np.float32)
    params = {k: bp.tensor(v) for k, v in inputs.params.items()}
    return inputs, params, [bp.tensor(a) for a in inputs.batch(True)]


# Compiled drivers that call their loops by address (BACKPLAN_DRIVER_LOOPS=address,
# codegen/build/loop_calls.py): the driver's own statements, which allocate, are compiled and
# counted as in the default (linked) form, and its compile is about half (empty kernel cache,
# library compiled: lstm12 4.1 -> 1.8, lstm48 4.2 -> 2.3, mlp_deep 3.9 -> 1.5, transformer
# 7.4 -> 4.6, the frontier test 5.7 -> 2.2 CPU s). The other models keep linked drivers.
BY_ADDRESS = ("lstm12", "lstm48", "mlp_deep", "transformer")


@pytest.mark.parametrize("name", [n for n, spec in MODELS.items() if spec.train])
def test_every_bench_model_step_holds_what_its_plan_predicts(name, backend, monkeypatch):
    if backend == "numba" and name in BY_ADDRESS:
        monkeypatch.setenv("BACKPLAN_DRIVER_LOOPS", "address")
    inputs, params, batch = _model(name)
    step = bp.value_and_grad(bench_function(MODELS[name]))
    measured = _measured(lambda: step(params, *batch))
    predicted = predicted_peak(joint_calls(step.trace(params, *batch).plan, 1), backend)
    assert measured.peak == predicted.allocated_peak_bytes
    assert predicted.input_bytes == inputs.nbytes


@pytest.mark.parametrize("name", ["mlp_tiny", "cnn", "transformer"])
def test_a_bench_model_training_step_with_adam_holds_what_its_plan_predicts(
    name, backend, monkeypatch
):
    """The step users run: value_and_grad and the optimizer's update in one compiled
    function, parameters and optimizer state donated (written in place on numba). On numba
    the driver runs as Python, as a first call does by default, calling each loop's address
    form, all compiled in one module; a compiled driver types every loop again inside its one
    function (empty kernel cache, library compiled, cnn + transformer: 13.3 against 2.3 CPU s).
    The donated step under a compiled driver: test_a_donated_training_step_holds_what_its_plan_
    predicts; the bench models' value_and_grad steps above keep theirs."""
    if backend == "numba":
        monkeypatch.setenv("BACKPLAN_DRIVER", "python")
    _, params, batch = _model(name)
    opt = bp.optim.adam(1e-3)
    loss = bench_function(MODELS[name])
    held = {"params": params, "state": opt.init(params)}
    del params  # a donated tensor kept alive keeps its old buffer

    @bp.compile(donate_argnums=(0, 1))
    def train_step(params, state, *batch):
        value, grads = bp.value_and_grad(loss)(params, *batch)
        params, state = opt.update(grads, state, params)
        return params, state, value

    def step():
        held["params"], held["state"], _ = train_step(held["params"], held["state"], *batch)

    measured = _measured(step)
    program = train_step.trace(held["params"], held["state"], *batch).program
    predicted = predicted_peak(region_calls(program.plans), backend)
    assert measured.peak == predicted.allocated_peak_bytes
    passed = bp.tree.leaves((held["params"], held["state"], batch))
    assert predicted.input_bytes == sum(leaf.nbytes for leaf in passed)  # the state included


def test_forward_then_backward_holds_both_arenas_saved_buffers_and_gradients(backend):
    rng = np.random.default_rng(0)
    w = bp.tensor(rng.standard_normal((12, 8)).astype(np.float32), requires_grad=True)
    x = bp.tensor(rng.standard_normal((16, 12)).astype(np.float32))

    @bp.compile
    def loss(x, w):
        return bp.tanh(x @ w).sum()

    def step():
        loss(x, w).backward()
        w.grad = None

    measured = _measured(step)
    predicted = predicted_peak(region_calls(loss.trace(x, w).program.plans), backend)
    assert measured.peak == predicted.allocated_peak_bytes
    most = {c: max(s.held[c] for s in predicted.steps) for c in ("saved", "gradients")}
    # w's gradient, and while backward()'s plan runs its seed (a float32 1.0 it allocates)
    assert most["saved"] > 0 and most["gradients"] == 12 * 8 * 4 + 4


def test_a_donated_training_step_holds_what_its_plan_predicts(backend):
    rng = np.random.default_rng(0)
    opt = bp.optim.adam(1e-2)
    params = {"w": bp.tensor(rng.standard_normal((12, 4)).astype(np.float32))}
    held = {"params": params, "state": opt.init(params)}
    del params  # as in a training loop: a donated tensor kept alive keeps its old buffer
    x = bp.tensor(rng.standard_normal((16, 12)).astype(np.float32))

    @bp.compile(donate_argnums=(0, 1))
    def train_step(params, state, x):
        loss, grads = bp.value_and_grad(lambda p: bp.mean(bp.tanh(x @ p["w"]) ** 2))(params)
        params, state = opt.update(grads, state, params)
        return params, state, loss

    def step():
        held["params"], held["state"], _ = train_step(held["params"], held["state"], x)

    measured = _measured(step)
    program = train_step.trace(held["params"], held["state"], x).program
    predicted = predicted_peak(region_calls(program.plans), backend)
    assert measured.peak == predicted.allocated_peak_bytes
    assert predicted.at_peak()["donated"] >= 3 * 12 * 4 * 4  # w and its two moments


@pytest.mark.parametrize("backend", ["numba"], indirect=True)
def test_a_buffer_the_prediction_lacks_is_named(backend):
    graph, arrays, wrt = batch_graph(sample_batches("f32")[0], "f32")
    compiled = CompiledPlan(lower(build_joint_plan(graph, wrt)))
    predicted, keys, packing = compiled._checked
    compiled._checked = ([b for b in predicted if b.key != "output 0"], keys, packing)
    with pytest.raises(MemoryCheckError, match=r"output 0 \(\d+ B\) was allocated but is not"):
        compiled(list(arrays))


def _deep_tanh(ws, x):
    h = x
    for w in ws:
        h = bp.tanh(h @ w)
    return (h * h).mean()


def test_every_frontier_point_is_the_peak_its_compiled_step_reaches(backend, monkeypatch):
    """memory_frontier's numbers are the step's own accounting: compiled at each point's
    budget, the checked mode measures exactly that peak in a loop, on either backend (the
    reference interpreter's rows are simulated without building their plans,
    BudgetPlanner.analytic_peak; the compiled rows are each plan's lowering). Compiled drivers
    call their loops by address, as BY_ADDRESS's models."""
    if backend == "numba":
        monkeypatch.setenv("BACKPLAN_DRIVER_LOOPS", "address")
    rng = np.random.default_rng(0)
    ws = [bp.tensor(rng.standard_normal((64, 64)).astype(np.float32) * 0.2) for _ in range(6)]
    x = bp.tensor(rng.standard_normal((128, 64)).astype(np.float32))
    front = bp.value_and_grad(_deep_tanh).memory_frontier(ws, x)
    assert len(front.points) >= 2  # rows lowering the peak < 1% are folded (4df373e)
    for point in front.points:
        step = bp.value_and_grad(_deep_tanh, max_peak_bytes=point.peak_bytes)
        # in the loop users write: the last loss and gradients bound while the next call runs
        counted = counted_in_a_loop(lambda: step(ws, x), 3)  # noqa: B023 - called here
        assert max(counted) + front.input_bytes == point.peak_bytes


def test_an_output_fed_back_as_a_donated_input_is_donated(backend):
    """A compiled plan reuses its big outputs' buffers in the next call unless someone holds
    them; an output of a donated input's type may come back as that donated input (a training
    step's new state, which the pairing gave another input's buffer), so it is not kept: a
    kept one stopped the donation, and the step allocated what the plan says it writes in
    place (mlp_deep's training step, from its second call)."""
    rng = np.random.default_rng(0)
    held = {"w": bp.tensor(rng.standard_normal((128, 128)).astype(np.float32))}
    x = bp.tensor(rng.standard_normal((4, 128)).astype(np.float32))

    @bp.compile(donate_argnums=(0,))
    def step(w, x):
        return w - 0.1 * bp.tanh(x @ w).mean(), w * 2.0  # the second: not written in place

    def rotate():
        _, held["w"] = step(held["w"], x)  # the output written fresh goes back in, donated

    measured = _measured(rotate)
    predicted = predicted_peak(region_calls(step.trace(held["w"], x).program.plans), backend)
    assert measured.peak == predicted.allocated_peak_bytes
