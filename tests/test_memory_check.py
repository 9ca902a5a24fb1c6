"""The checked mode (BACKPLAN_CHECK_MEMORY=1): every compiled call's buffers are counted and
must equal its plan's prediction to the byte, and a step's measured peak equals the predicted
peak (ir/peak.py) less the caller's arrays. Runs over every op sample (the batches
test_codegen.py compiles, so the kernels are cached) and every bench model at its small size."""

from __future__ import annotations

import numpy as np
import pytest
from test_codegen import batch_graph, sample_batches

import backplan as bp
from backplan.bench.models import MODELS
from backplan.bench.peers.backplan_peer import bench_function
from backplan.codegen.run.compiled import CompiledPlan
from backplan.codegen.run.memory_check import MemoryCheckError, checked_memory, measure
from backplan.ir.lowering import lower
from backplan.ir.peak import joint_calls, predicted_peak, region_calls
from backplan.ir.pipeline import build_joint_plan
from backplan.runtime.backend import use_backend


@pytest.fixture(autouse=True)
def _checked():
    with use_backend("numba"), checked_memory():
        yield


def _measured(step):
    """The step's measured peak, on its second call (the first compiles)."""
    step()
    with measure() as measured:
        step()
    return measured


@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_every_op_sample_holds_what_its_joint_plan_predicts(dtype):
    for samples in sample_batches(dtype):
        graph, arrays, wrt = batch_graph(samples, dtype)
        plan = build_joint_plan(graph, wrt)
        compiled = CompiledPlan(lower(plan))
        measured = _measured(lambda: compiled(list(arrays)))  # noqa: B023 - called here
        predicted = predicted_peak(joint_calls(plan, 1 + len(samples)), "numba")
        assert measured.peak == predicted.allocated_peak_bytes, [s.id for s in samples]


@pytest.mark.parametrize("name", [n for n, spec in MODELS.items() if spec.train])
def test_every_bench_model_step_holds_what_its_plan_predicts(name):
    spec = MODELS[name]
    inputs = spec.inputs(small=True, dtype=np.float32)
    params = {k: bp.tensor(v) for k, v in inputs.params.items()}
    batch = [bp.tensor(a) for a in inputs.batch(True)]
    step = bp.value_and_grad(bench_function(spec))
    measured = _measured(lambda: step(params, *batch))
    predicted = predicted_peak(joint_calls(step.trace(params, *batch).plan, 1), "numba")
    assert measured.peak == predicted.allocated_peak_bytes
    assert predicted.input_bytes == inputs.nbytes


def test_forward_then_backward_holds_both_arenas_saved_buffers_and_gradients():
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
    predicted = predicted_peak(region_calls(loss.trace(x, w).program.plans), "numba")
    assert measured.peak == predicted.allocated_peak_bytes
    assert predicted.at_peak()["saved"] > 0 and predicted.at_peak()["gradients"] == 12 * 8 * 4


def test_a_donated_training_step_holds_what_its_plan_predicts():
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
    predicted = predicted_peak(region_calls(program.plans), "numba")
    assert measured.peak == predicted.allocated_peak_bytes
    assert predicted.at_peak()["donated"] >= 3 * 12 * 4 * 4  # w and its two moments


def test_a_buffer_the_prediction_lacks_is_named():
    graph, arrays, wrt = batch_graph(sample_batches("f32")[0], "f32")
    compiled = CompiledPlan(lower(build_joint_plan(graph, wrt)))
    predicted, keys = compiled._checked
    compiled._checked = ([b for b in predicted if b.key != "output 0"], keys)
    with pytest.raises(MemoryCheckError, match=r"output 0 \(\d+ B\) was allocated but is not"):
        compiled(list(arrays))
