"""fn.profile(*args) (tracer/kernel_profile.py): measured seconds per kernel, one per step of
explain's report.peak.steps, that report.save_trace writes as each kernel's length; the
kernels' sum fits inside each timed call; donated arguments stay the caller's."""

import json

import numpy as np
import pytest

import backplan as bp

pytestmark = pytest.mark.numba

RNG = np.random.default_rng(0)
PARAMS = {
    "w1": bp.tensor(RNG.standard_normal((16, 32)).astype(np.float32) * 0.2),
    "w2": bp.tensor(RNG.standard_normal((32, 4)).astype(np.float32) * 0.2),
}
X = RNG.standard_normal((64, 16)).astype(np.float32)


def loss(p, x):
    return bp.mean(bp.tanh(x @ p["w1"]) @ p["w2"])


def test_each_kernel_gets_its_measured_seconds_in_the_trace(tmp_path):
    step = bp.value_and_grad(loss)
    profile = step.profile(PARAMS, X, repeat=3)
    report = step.explain(PARAMS, X)
    assert len(profile.seconds) == len(report.peak.steps) > 3
    assert all(np.isfinite(s) and s > 0 for s in profile.seconds)
    assert len(profile.kernel_shares) == 3  # each timed call's kernels run inside it
    assert all(0 < share <= 1 for share in profile.kernel_shares), profile.kernel_shares
    assert profile.call_seconds > 0 and str(profile).startswith(f"{len(report.peak.steps)} kernels")
    path = tmp_path / "step.json"
    report.save_trace(path, times=profile)
    kernels = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert [e["dur"] for e in kernels] == pytest.approx([s * 1e6 for s in profile.seconds])


def test_a_donated_training_step_is_profiled_on_copies():
    opt = bp.optim.adam(1e-3)
    state = opt.init(PARAMS)

    @bp.compile(donate_argnums=(0, 1))
    def train(p, s, x):
        value, grads = bp.value_and_grad(loss)(p, x)
        p, s = opt.update(grads, s, p)
        return p, s, value

    profile = train.profile(PARAMS, state, X, repeat=2, warmup=2)
    assert len(profile.seconds) == len(train.explain(PARAMS, state, X).peak.steps)
    assert float(bp.sum(PARAMS["w1"])) == pytest.approx(float(np.sum(PARAMS["w1"].numpy())))


@pytest.mark.reference
def test_a_step_on_the_interpreter_or_a_bad_repeat_is_refused():
    from backplan.runtime.backend import use_backend

    step = bp.value_and_grad(loss)
    with pytest.raises(ValueError, match="repeat is the number of timed calls"):
        step.profile(PARAMS, X, repeat=0)
    with use_backend("reference"), pytest.raises(RuntimeError, match="reference interpreter"):
        step.profile(PARAMS, X, repeat=1, warmup=1)


def test_a_compiled_loss_is_profiled_with_its_backward_as_the_loop_runs_it(tmp_path):
    params = {k: bp.tensor(v.numpy(), requires_grad=True) for k, v in PARAMS.items()}
    compiled = bp.compile(loss)
    profile = compiled.profile(params, X, repeat=2, warmup=3)
    assert all(p.grad is None for p in params.values())  # the caller's gradients untouched
    report = compiled.explain(params, X)
    path = tmp_path / "loss.json"
    report.save_trace(path, times=profile)  # from call 3 one joint plan: its kernels
    kernels = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert len(kernels) == len(profile.seconds)
    assert {e["cat"] for e in kernels} == {"joint"}


def test_another_threads_compiled_calls_stay_out_of_the_profile():
    """measuring() swaps CompiledPlan.__call__ for the whole process: a compiled function
    another thread calls meanwhile must not add its plan to this thread's profile (a
    profile beside a serving thread failed with 'different plans from call to call')."""
    import threading

    from backplan.runtime.kernel_times import measuring

    other = bp.compile(lambda x: bp.exp(x) + 1.0)
    y = bp.tensor(np.ones((64, 64), np.float32))
    other(y)
    other(y)
    got = []
    with measuring() as calls:
        thread = threading.Thread(target=lambda: got.append(other(y).numpy()))
        thread.start()
        thread.join()
    assert calls == []
    np.testing.assert_allclose(got[0], np.e + 1.0, rtol=1e-6)
