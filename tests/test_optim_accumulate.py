"""bp.optim.accumulate: k updates on micro-batches step as one update on their union would (the
mean of equal micro-batches' mean gradients is the big batch's mean gradient); the k - 1 updates
between leave the parameters alone; a compiled step (traced count, where-selected) gives the
eager step's bytes."""

import numpy as np
import pytest

import backplan as bp
from backplan.examples.mlp import init_mlp, mlp_loss, synthetic_classification

STEPS = 3


@pytest.mark.parametrize(
    "inner", [bp.optim.sgd(0.1, momentum=0.9), bp.optim.adam(0.01)], ids=["sgd", "adam"]
)
def test_k_micro_batches_step_as_one_big_batch(inner):
    x, y = synthetic_classification(16, 8, 4)
    vg = bp.value_and_grad(mlp_loss)
    params = init_mlp([8, 16, 4])
    opt = bp.optim.accumulate(inner, steps=2)

    @bp.compile
    def compiled(p, s, a, b):
        return opt.update(vg(p, a, b)[1], s, p)

    big, big_state = params, inner.init(params)
    eager, state = params, opt.init(params)
    traced, traced_state = params, opt.init(params)
    for _ in range(STEPS):
        big, big_state = inner.update(vg(big, x, y)[1], big_state, big)
        for half, rows in enumerate((slice(0, 8), slice(8, 16))):
            before = eager
            eager, state = opt.update(vg(eager, x[rows], y[rows])[1], state, eager)
            traced, traced_state = compiled(traced, traced_state, x[rows], y[rows])
            if half == 0:
                assert eager is before  # no step between updates
        for k in params:
            np.testing.assert_allclose(eager[k].numpy(), big[k].numpy(), rtol=1e-5, atol=1e-6)
            np.testing.assert_array_equal(traced[k].numpy(), eager[k].numpy())
    assert int(state["micro"].item()) == 0 and int(state["inner"]["count"].item()) == STEPS
    assert not np.any(state["grads"]["w0"].numpy())  # the sum restarts after each step


def test_accumulate_checks_its_arguments_and_state():
    params = {"w": bp.tensor([1.0, 2.0])}
    with pytest.raises(ValueError, match=r"steps must be a whole number >= 1, got 0"):
        bp.optim.accumulate(bp.optim.sgd(0.1), steps=0)
    with pytest.raises(TypeError, match="wraps an optimizer"):
        bp.optim.accumulate(lambda g: g, steps=2)
    opt = bp.optim.accumulate(bp.optim.sgd(0.1), steps=2)
    with pytest.raises(TypeError, match=r"state of its own init\(params\)"):
        opt.update(params, bp.optim.sgd(0.1).init(params), params)
    assert opt.elementwise
    clipped = bp.optim.chain(bp.optim.clip_by_global_norm(1.0), bp.optim.sgd(0.1))
    assert not bp.optim.accumulate(clipped, steps=2).elementwise


@pytest.mark.parametrize("backend", ["numba", "reference"])
@pytest.mark.parametrize(
    "inner", [bp.optim.sgd(0.1, momentum=0.9), bp.optim.adam(0.01)], ids=["sgd", "adam"]
)
def test_the_update_compiled_on_its_own_steps_as_the_eager_one(inner, backend):
    """bp.compile(opt.update), as data_parallel(optimizer=...) runs the update: accumulate of
    adam failed to lower (KeyError in ir/fusion.py: a loop's value that one input's cone left
    to be read was recomputed by another input's cone, so no reader was recorded for it)."""
    from backplan.runtime.backend import use_backend

    rng = np.random.default_rng(0)
    params = {"w": bp.tensor(rng.standard_normal((8, 15)).astype(np.float32))}
    opt = bp.optim.accumulate(inner, steps=2)
    with use_backend(backend):
        update = bp.compile(opt.update)
        eager, state = params, opt.init(params)
        traced, traced_state = params, opt.init(params)
        for _ in range(4):
            grads = {"w": bp.tensor(rng.standard_normal((8, 15)).astype(np.float32))}
            eager, state = opt.update(grads, state, eager)
            traced, traced_state = update(grads, traced_state, traced)
            # the reference interpreter runs NumPy's ops: the same bits; numba's fused loops
            # may contract a multiply-add (one rounding less)
            tolerance = 0 if backend == "reference" else 2e-7
            np.testing.assert_allclose(
                traced["w"].numpy(), eager["w"].numpy(), rtol=tolerance, atol=tolerance
            )
        assert not np.array_equal(traced["w"].numpy(), params["w"].numpy())


@pytest.mark.filterwarnings("ignore::backplan.optim.PrecisionWarning")
@pytest.mark.parametrize("master", [False, True], ids=["bf16", "bf16-master"])
def test_16_bit_gradients_are_summed_in_float32_and_rounded_once(master):
    """bfloat16 parameters, steps=4: the four gradients are added in float32 (state["grads"]
    is float32) and their mean rounded into bfloat16 once, or handed as it is to an optimizer
    with float32 master weights; they were added in bfloat16, which rounded each addition (the
    sum of these gradients so taken differs from the float32 one). The compiled update keeps
    the mean in float32 inside the loop that subtracts it and rounds once (docs/ops.md), on
    either backend: without master weights not the eager update's bytes, which round each op."""
    import ml_dtypes

    rng = np.random.default_rng(1)
    shape = (8, 33)
    params = {"w": bp.tensor(rng.standard_normal(shape).astype(ml_dtypes.bfloat16))}
    grads = [rng.standard_normal(shape).astype(ml_dtypes.bfloat16) for _ in range(4)]
    inner = bp.optim.sgd(1.0, master_dtype=bp.float32 if master else None)
    opt = bp.optim.accumulate(inner, steps=4)
    state = opt.init(params)
    assert state["grads"]["w"].numpy().dtype == np.float32
    update = bp.compile(opt.update)
    eager, traced, traced_state = params, params, opt.init(params)
    for g in grads:
        eager, state = opt.update({"w": bp.tensor(g)}, state, eager)
        traced, traced_state = update({"w": bp.tensor(g)}, traced_state, traced)
    total = np.zeros(shape, np.float32)
    total16 = np.zeros(shape, ml_dtypes.bfloat16)
    for g in grads:
        total += g.astype(np.float32)
        total16 = (total16 + g).astype(ml_dtypes.bfloat16)
    mean = total / np.float32(4)
    assert (mean.astype(ml_dtypes.bfloat16) != (total16.astype(np.float32) / 4)).any()
    w = params["w"].numpy()
    if master:  # float32 master weights minus the float32 mean, rounded once
        want = (w.astype(np.float32) - mean).astype(ml_dtypes.bfloat16)
    else:
        want = w.astype(np.float32) - mean.astype(ml_dtypes.bfloat16).astype(np.float32)
        want = want.astype(ml_dtypes.bfloat16)
    got = eager["w"].numpy()
    assert got.dtype == ml_dtypes.bfloat16
    assert (got.view(np.uint16) == want.view(np.uint16)).all(), int((got != want).sum())
    fused = (w.astype(np.float32) - mean).astype(ml_dtypes.bfloat16)
    assert (traced["w"].numpy().view(np.uint16) == fused.view(np.uint16)).all()
    assert master or (fused != want).any()
    with pytest.raises(TypeError, match=r"state\['grads'\]\['w'\] is bf16\[8, 33\] but the sum"):
        opt.update({"w": bp.tensor(grads[0])}, {**state, "grads": params}, eager)
