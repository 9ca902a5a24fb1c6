"""Mixed precision as users write it: float32 master weights for 16-bit parameters
(master_dtype on every optimizer) and dynamic loss scaling for float16 (bp.optim.loss_scale)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import backplan as bp
from backplan.runtime.backend import use_backend

# several tests step 16-bit parameters without master weights on purpose (to compare, or to
# test the refusal); the warning itself is tested below
pytestmark = pytest.mark.filterwarnings("ignore::backplan.optim.PrecisionWarning")


@pytest.mark.parametrize("make", [bp.optim.sgd, bp.optim.adam, bp.optim.adamw])
def test_master_weights_keep_steps_that_16_bits_round_away(make):
    params = {"w": bp.tensor(np.ones(4, bp.bfloat16))}
    grads = {"w": bp.tensor(np.full(4, 1.0, bp.bfloat16))}  # adam steps by lr: same numbers
    moved = {}
    for master in (None, bp.float32):
        opt = make(1e-4, master_dtype=master)
        state, p = opt.init(params), params
        for _ in range(40):
            p, state = opt.update(grads, state, p)
        assert p["w"].dtype == bp.bfloat16
        moved[master] = 1.0 - float(p["w"].numpy()[0])
    assert moved[None] == 0.0  # 1 - 1e-4 rounds back to 1 in bfloat16, every step
    kept = state["master"]["w"].numpy()
    assert 1.0 - kept[0] == pytest.approx(40e-4, rel=0.02)  # 40 steps, kept in float32
    np.testing.assert_array_equal(p["w"].numpy(), kept.astype(bp.bfloat16))  # rounded once
    state = bp.optim.sgd(0.1, master_dtype=bp.float32).init(params)
    assert state["master"]["w"].dtype == np.float32


def test_a_float32_parameter_is_its_own_master_weight_and_is_donated_in_place():
    """One script for every dtype passes master_dtype=bp.float32 to a float32 model too. The
    master slot of a float32 parameter held the parameter's own buffer and each step returned
    one buffer as both: donated back, neither was written in place (a fresh allocation a step,
    beside explain's peak; BACKPLAN_CHECK_MEMORY=1 raised on every call)."""
    from backplan.codegen.run.memory_check import checked_memory

    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 4)).astype(np.float32)
    h = w[0].astype(bp.bfloat16)
    x = rng.standard_normal((8, 16)).astype(np.float32)
    opt, plain = bp.optim.adam(1e-2, master_dtype=bp.float32), bp.optim.adam(1e-2)
    p = {"w": bp.tensor(w), "h": bp.tensor(h)}
    s = opt.init(p)
    assert s["master"]["w"] is None and s["master"]["h"].dtype == np.float32

    def loss(p):
        return bp.mean(bp.tanh(x @ p["w"] + p["h"].astype(bp.float32)))

    @bp.compile(donate_argnums=(0, 1))
    def step(p, s):
        value, grads = bp.value_and_grad(loss)(p)
        return (*opt.update(grads, s, p), value)

    with use_backend("numba"), checked_memory():
        for _ in range(3):
            buffer = p["w"].numpy().__array_interface__["data"][0]
            p, s, _ = step(p, s)  # checked: raises where a buffer is not the predicted one
            assert p["w"].numpy().__array_interface__["data"][0] == buffer  # written in place
    eager = {"w": bp.tensor(w), "h": bp.tensor(h)}
    eager_s = opt.init(eager)
    only_w, plain_w = {"w": bp.tensor(w)}, {"w": bp.tensor(w)}
    only_s, plain_s = opt.init(only_w), plain.init(plain_w)
    for _ in range(3):
        eager, eager_s = opt.update(bp.grad(loss)(eager), eager_s, eager)
        g = {"w": bp.tensor(np.full_like(w, 0.5))}
        only_w, only_s = opt.update(g, only_s, only_w)
        plain_w, plain_s = plain.update(g, plain_s, plain_w)
    assert s["master"]["w"] is None and p["h"].dtype == bp.bfloat16
    np.testing.assert_allclose(p["w"].numpy(), eager["w"].numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(s["master"]["h"].numpy(), eager_s["master"]["h"].numpy(), rtol=1e-5)
    np.testing.assert_array_equal(only_w["w"].numpy(), plain_w["w"].numpy())  # as without master


def test_master_dtype_is_checked_and_not_ignored_inside_a_chain():
    with pytest.raises(ValueError, match="master weights are kept in"):
        bp.optim.sgd(0.1, master_dtype=bp.bfloat16)
    with pytest.raises(ValueError, match="pass master_dtype to bp.optim.chain"):
        bp.optim.chain(
            bp.optim.clip_by_global_norm(1.0), bp.optim.sgd(0.1, master_dtype=bp.float32)
        )
    opt = bp.optim.chain(
        bp.optim.clip_by_global_norm(1.0), bp.optim.sgd(0.1), master_dtype=bp.float32
    )
    params = {"w": bp.tensor(np.ones(2, np.float16))}
    new, _ = opt.update({"w": bp.tensor(np.ones(2, np.float16))}, opt.init(params), params)
    assert new["w"].dtype == np.float16


def _regression(rng, n=64, d=8):
    x = rng.standard_normal((n, d)).astype(np.float16)
    w_true = rng.standard_normal((d, 1))
    y = (x.astype(np.float64) @ w_true).astype(np.float16)
    return x, y


def _loss(p, x, y):
    # the loss is tiny, so its float16 gradients underflow to zero unless scaled up
    return bp.mean((x @ p["w"] - y) ** 2) * 1e-6


def _train(opt, steps, scaled):
    rng = np.random.default_rng(0)
    x, y = _regression(rng)
    params = {"w": bp.tensor(np.zeros((8, 1), np.float16))}
    state = opt.init(params)

    @bp.compile
    def step(params, state, x, y):
        scale = state["scale"] if scaled else 1.0
        loss, grads = bp.value_and_grad(lambda p: _loss(p, x, y) * scale)(params)
        params, state = opt.update(grads, state, params)
        return params, state, loss

    for _ in range(steps):
        params, state, _ = step(params, state, x, y)
    return float(_loss(params, bp.tensor(x), bp.tensor(y)).item()) * 1e6, state


def test_dynamic_loss_scaling_trains_where_float16_underflows():
    plain, _ = _train(bp.optim.sgd(3e4, master_dtype=bp.float32), 30, scaled=False)
    scaled, state = _train(
        bp.optim.loss_scale(bp.optim.sgd(3e4, master_dtype=bp.float32), growth_interval=10),
        30,
        scaled=True,
    )
    start, _ = _train(bp.optim.sgd(0.0), 1, scaled=False)
    assert plain == pytest.approx(start, rel=1e-3)  # every gradient underflowed to zero
    assert scaled < 0.05 * start
    # 2**15 times the first gradients overflows float16: those steps were skipped, the scale
    # backed off, then grew again every 10 finite steps
    assert int(state["skipped"].item()) >= 1


def test_a_skipped_step_leaves_parameters_and_state_unchanged():
    params = {"w": bp.tensor(np.array([1.0, 2.0], np.float16))}
    opt = bp.optim.loss_scale(bp.optim.adam(0.1, eps=1e-4), init_scale=8.0, growth_interval=2)
    state = opt.init(params)
    bad = {"w": bp.tensor(np.array([np.nan, 1.0], np.float16))}
    new, after = opt.update(bad, state, params)
    np.testing.assert_array_equal(new["w"].numpy(), params["w"].numpy())
    assert int(after["inner"]["count"].item()) == 0 and int(after["skipped"].item()) == 1
    assert float(after["scale"].item()) == 4.0
    good = {"w": bp.tensor(np.array([4.0, 4.0], np.float16))}
    for _ in range(2):
        new, after = opt.update(good, after, new)
    assert float(after["scale"].item()) == 8.0 and int(after["good_steps"].item()) == 0
    assert not np.array_equal(new["w"].numpy(), params["w"].numpy())


@pytest.mark.parametrize("make", [bp.optim.adam, bp.optim.adamw])
def test_adam_on_float16_refuses_an_eps_that_rounds_to_zero(make):
    # eps=1e-8 is 0 in float16: a zero gradient would step by 0 / 0 (NaN) on the first update
    params = {"w": bp.tensor(np.ones(3, np.float16))}
    with warnings.catch_warnings():  # the refusal alone: no PrecisionWarning before it
        warnings.simplefilter("error", bp.optim.PrecisionWarning)
        with pytest.raises(ValueError, match=r"eps=1e-08 rounds to 0 in float16.*master_dtype"):
            make(1e-3).init(params)
        with pytest.raises(ValueError, match="rounds to 0 in float16"):
            bp.optim.chain(bp.optim.clip_by_global_norm(1.0), make(1e-3)).init(params)
    grads = {"w": bp.tensor(np.array([0.0, 1e-3, 1.0], np.float16))}
    for opt in (make(1e-3, master_dtype=bp.float32), make(1e-3, eps=1e-4)):
        new, _ = opt.update(grads, opt.init(params), params)
        assert np.all(np.isfinite(new["w"].numpy()))
    assert make(1e-3).init({"w": bp.tensor(np.ones(3, bp.bfloat16))})  # bfloat16 holds 1e-8


def test_sixteen_bit_parameters_without_master_weights_warn_at_init():
    params = {"w": bp.tensor(np.ones(3, bp.bfloat16)), "b": bp.tensor(np.ones(2, np.float32))}
    with pytest.warns(bp.optim.PrecisionWarning, match=r"1 parameter\(s\).*\['w'\].*master_dtype"):
        state = bp.optim.sgd(1e-3).init(params)
    stepped, _ = bp.optim.sgd(1e-3).update(
        {k: bp.ones_like(v) for k, v in params.items()}, state, params
    )
    assert stepped["w"].tolist() == [1.0] * 3  # what the warning says: the step rounds away

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bp.optim.sgd(1e-3, master_dtype=bp.float32).init(params)
        bp.optim.adam(1e-3).init({"b": params["b"]})


@pytest.mark.parametrize("backend", ["reference", "numba"])
@pytest.mark.parametrize("dtype", [bp.bfloat16, np.float16])
def test_a_16_bit_cross_entropy_gradient_rounds_once(backend, dtype):
    """The loss's gradient is computed in float32 and rounded once (as autocast runs the loss
    in float32): each element within the dtype's rounding of float64's, the confident rows'
    small true-class gradients included. Probabilities rounded to bfloat16 before `- onehot`
    put them 1.6% off (median), and at 0 where p rounded to 1."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((48, 10)) * 3).astype(np.float32)
    x[:, 0] += np.linspace(2, 9, 48, dtype=np.float32)  # p of class 0 from ~0.5 to ~0.9999
    x = x.astype(dtype)
    labels = bp.tensor(np.zeros(48, np.int64))
    grad = bp.grad(lambda logits: bp.cross_entropy(logits, labels))
    want = grad(bp.tensor(x.astype(np.float64))).numpy()
    with use_backend(backend):
        got = bp.compile(grad)(bp.tensor(x))
    assert got.dtype == dtype
    # half an ulp plus float32 slack; float16's subnormals (below 6.1e-5) have a fixed ulp
    rtol, atol = (2.0**-8, 1e-30) if dtype == bp.bfloat16 else (2.0**-11, 2.0**-24)
    np.testing.assert_allclose(got.numpy().astype(np.float64), want, rtol=rtol, atol=atol)
