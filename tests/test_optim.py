"""bp.optim against NumPy implementations of the torch.optim formulas, over several steps;
eager and compiled steps agree; schedules and clipping; torch itself where installed."""

import math
import re
from pathlib import Path

import numpy as np
import pytest

import backplan as bp

STEPS = 5


def make_problem(seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    params = {"w": rng.standard_normal((3, 4)).astype(dtype), "b": rng.standard_normal(4)}
    params["b"] = params["b"].astype(dtype)
    grads = [
        {k: rng.standard_normal(v.shape).astype(dtype) for k, v in params.items()}
        for _ in range(STEPS)
    ]
    return params, grads


def as_tensors(tree):
    return {k: bp.tensor(v) for k, v in tree.items()}


def run_bp(opt, params, grads):
    """The optimizer applied eagerly for every step's gradients; NumPy arrays out."""
    p = as_tensors(params)
    state = opt.init(p)
    for g in grads:
        p, state = opt.update(as_tensors(g), state, p)
    return {k: v.numpy() for k, v in p.items()}, state


# ---- NumPy references of torch.optim ----------------------------------------------------------


def ref_sgd(params, grads, lr, momentum=0.0, nesterov=False, weight_decay=0.0):
    p = {k: v.copy() for k, v in params.items()}
    buf = {k: None for k in p}
    for g in grads:
        for k in p:
            d = g[k] + weight_decay * p[k]
            if momentum:
                buf[k] = d.copy() if buf[k] is None else momentum * buf[k] + d
                d = d + momentum * buf[k] if nesterov else buf[k]
            p[k] = p[k] - lr * d
    return p


def ref_adam(params, grads, lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0, decoupled=False):
    p = {k: v.copy() for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(x) for k, x in p.items()}
    for t, g in enumerate(grads, start=1):
        rate = lr(t - 1) if callable(lr) else lr
        for k in p:
            grad = g[k]
            if decoupled:
                p[k] = p[k] * (1 - rate * weight_decay)
            elif weight_decay:
                grad = grad + weight_decay * p[k]
            m[k] = b1 * m[k] + (1 - b1) * grad
            v[k] = b2 * v[k] + (1 - b2) * grad * grad
            denom = np.sqrt(v[k]) / math.sqrt(1 - b2**t) + eps
            p[k] = p[k] - rate / (1 - b1**t) * m[k] / denom
    return p


def assert_trees_close(actual, expected, rtol=2e-6, atol=2e-6):
    assert set(actual) == set(expected)
    for k in expected:
        np.testing.assert_allclose(actual[k], expected[k], rtol=rtol, atol=atol, err_msg=k)


# ---- optimizer math ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"momentum": 0.9},
        {"momentum": 0.9, "nesterov": True},
        {"momentum": 0.5, "weight_decay": 0.1},
        {"weight_decay": 0.01},
    ],
)
def test_sgd_matches_torch_formulas(options):
    params, grads = make_problem()
    actual, state = run_bp(bp.optim.sgd(0.1, **options), params, grads)
    assert_trees_close(actual, ref_sgd(params, grads, 0.1, **options))
    assert state["count"].item() == STEPS and state["count"].dtype == np.int64


@pytest.mark.parametrize(
    "name, options",
    [
        ("adam", {}),
        ("adam", {"b1": 0.8, "b2": 0.99, "eps": 1e-6, "weight_decay": 0.1}),
        ("adamw", {}),
        ("adamw", {"weight_decay": 0.1}),
    ],
)
def test_adam_and_adamw_match_torch_formulas(name, options):
    params, grads = make_problem(1)
    actual, state = run_bp(getattr(bp.optim, name)(0.01, **options), params, grads)
    decoupled = name == "adamw"
    options.setdefault("weight_decay", 0.01 if decoupled else 0.0)
    expected = ref_adam(params, grads, 0.01, decoupled=decoupled, **options)
    assert_trees_close(actual, expected)
    assert state["mu"]["w"].dtype == np.float32  # nothing widened to float64


def test_float64_params_stay_float64_and_match_closely():
    params, grads = make_problem(2, np.float64)
    actual, _ = run_bp(bp.optim.adam(0.01), params, grads)
    assert actual["w"].dtype == np.float64
    assert_trees_close(actual, ref_adam(params, grads, 0.01), rtol=1e-12, atol=1e-13)


def test_schedules_follow_their_formulas():
    cosine = bp.optim.cosine_decay(0.1, decay_steps=10, alpha=0.2)
    for step in (0, 3, 5, 10, 15):
        fraction = min(step, 10) / 10
        expected = 0.1 * (0.8 * 0.5 * (1 + math.cos(math.pi * fraction)) + 0.2)
        assert abs(float(cosine(step)) - expected) < 1e-9
    warmup = bp.optim.warmup_linear(0.5, warmup_steps=4, init_value=0.1)
    assert [round(float(warmup(s)), 12) for s in (0, 2, 4, 9)] == [0.1, 0.3, 0.5, 0.5]
    with pytest.raises(ValueError, match="decay_steps must be positive"):
        bp.optim.cosine_decay(0.1, 0)


def test_adam_with_a_schedule_uses_the_step_count():
    params, grads = make_problem(3)
    schedule = bp.optim.warmup_linear(0.05, warmup_steps=3)
    actual, _ = run_bp(bp.optim.adam(schedule), params, grads)
    expected = ref_adam(params, grads, lambda step: 0.05 * min(step, 3) / 3)
    assert_trees_close(actual, expected)


def test_clip_by_global_norm_scales_all_leaves_together():
    params, grads = make_problem(4)
    norm = math.sqrt(sum(float((g * g).sum()) for g in grads[0].values()))
    opt = bp.optim.chain(bp.optim.clip_by_global_norm(1.0), bp.optim.sgd(1.0))
    actual, state = run_bp(opt, params, grads[:1])
    coefficient = 1.0 / (norm + 1e-6)
    expected = {k: params[k] - coefficient * grads[0][k] for k in params}
    assert norm > 1.0 and isinstance(state, tuple) and len(state) == 2
    assert_trees_close(actual, expected)
    unclipped, _ = run_bp(
        bp.optim.chain(bp.optim.clip_by_global_norm(100.0), bp.optim.sgd(1.0)), params, grads[:1]
    )
    assert_trees_close(unclipped, {k: params[k] - grads[0][k] for k in params})


def test_eager_update_keeps_requires_grad_so_backward_works_next_step():
    w = bp.tensor(np.array([1.0, -2.0], np.float32), requires_grad=True)
    params = {"w": w}
    opt = bp.optim.sgd(0.1, momentum=0.9)
    state = opt.init(params)
    for _ in range(3):
        loss = (params["w"] * params["w"]).sum()
        loss.backward()
        params, state = opt.update({"w": params["w"].grad}, state, params)
        assert params["w"].requires_grad and params["w"].is_leaf
    assert float((params["w"] * params["w"]).sum().item()) < 5.0


def test_bad_inputs_raise_clear_errors():
    params = {"w": bp.tensor([1.0, 2.0])}
    opt = bp.optim.adam(0.1)
    state = opt.init(params)
    with pytest.raises(TypeError, match=r"different structures, at the top: keys only the first"):
        opt.update({"v": bp.tensor([1.0, 2.0])}, state, params)
    with pytest.raises(TypeError, match=r"grad \['w'\] has shape \(3,\)"):
        opt.update({"w": bp.tensor([1.0, 2.0, 3.0])}, state, params)
    with pytest.raises(TypeError, match="optimizers update float tensors"):
        opt.init({"n": bp.tensor([1, 2])})
    with pytest.raises(ValueError, match="b1 must be at least 0 and below 1"):
        bp.optim.adam(0.1, b1=1.0)
    with pytest.raises(ValueError, match="lr must be at least 0"):
        bp.optim.sgd(-0.1)
    with pytest.raises(TypeError, match="chain takes optimizers"):
        bp.optim.chain(0.1)


# ---- compiled steps ---------------------------------------------------------------------------


def mlp_loss(params, x, y):
    h = bp.tanh(x @ params["w"] + params["b"])
    return ((h - y) ** 2).mean()


@pytest.mark.reference
def test_compiled_step_equals_eager_step_with_traced_learning_rate():
    params, _ = make_problem(5)
    rng = np.random.default_rng(5)
    x, y = rng.standard_normal((6, 3)).astype(np.float32), rng.standard_normal((6, 4))
    y = y.astype(np.float32)
    opt_of = lambda lr: bp.optim.chain(  # noqa: E731
        bp.optim.clip_by_global_norm(0.5), bp.optim.adamw(lr, weight_decay=0.1)
    )

    @bp.compile
    def step(params, state, x, y, lr):
        loss, grads = bp.value_and_grad(mlp_loss)(params, x, y)
        params, state = opt_of(lr).update(grads, state, params)
        return params, state, loss

    compiled_p = eager_p = as_tensors(params)
    compiled_s = eager_s = opt_of(0.0).init(compiled_p)
    for i, lr in enumerate([0.01, 0.02, 0.005, 0.03]):
        compiled_p, compiled_s, loss = step(compiled_p, compiled_s, x, y, lr)
        eager_loss, grads = bp.value_and_grad(mlp_loss)(eager_p, x, y)
        eager_p, eager_s = opt_of(lr).update(grads, eager_s, eager_p)
        np.testing.assert_allclose(loss.numpy(), eager_loss.numpy(), rtol=1e-6)
        assert compiled_s[1]["count"].item() == i + 1
    assert_trees_close(
        {k: v.numpy() for k, v in compiled_p.items()}, {k: v.numpy() for k, v in eager_p.items()}
    )
    assert compiled_p["w"].dtype == np.float32
    assert step.cache_info().traces == 1  # four learning rates, one trace


@pytest.mark.reference
def test_compiled_step_with_a_cosine_schedule_does_not_retrace():
    params, _ = make_problem(6)
    rng = np.random.default_rng(6)
    x, y = rng.standard_normal((6, 3)).astype(np.float32), np.zeros((6, 4), np.float32)
    opt = bp.optim.sgd(bp.optim.cosine_decay(0.5, decay_steps=4), momentum=0.9)

    @bp.compile
    def step(params, state, x, y):
        loss, grads = bp.value_and_grad(mlp_loss)(params, x, y)
        return (*opt.update(grads, state, params), loss)

    p, s = as_tensors(params), opt.init(as_tensors(params))
    losses = []
    for _ in range(6):
        p, s, loss = step(p, s, x, y)
        losses.append(loss.item())
    assert step.cache_info().traces == 1 and losses[-1] < losses[0]
    eager_p, eager_s = as_tensors(params), opt.init(as_tensors(params))
    for _ in range(6):
        _, grads = bp.value_and_grad(mlp_loss)(eager_p, x, y)
        eager_p, eager_s = opt.update(grads, eager_s, eager_p)
    np.testing.assert_allclose(p["w"].numpy(), eager_p["w"].numpy(), rtol=1e-5, atol=1e-6)


# ---- torch, where installed -------------------------------------------------------------------


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_against_torch(name):
    torch = pytest.importorskip("torch")
    params, grads = make_problem(7)
    tensors = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    options = {"sgd": {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01}}.get(name, {})
    torch_opt = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[
        name
    ](list(tensors.values()), lr=0.01, **options)
    for g in grads:
        for k, t in tensors.items():
            t.grad = torch.tensor(g[k])
        torch_opt.step()
    actual, _ = run_bp(getattr(bp.optim, name)(0.01, **options), params, grads)
    assert_trees_close(actual, {k: t.detach().numpy() for k, t in tensors.items()})


def test_readme_training_loop_runs_and_learns(tmp_path, monkeypatch, capsys):
    """The README's training loop, exactly as written (on the reference backend the tests use)."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    start = readme.index("## A training loop")
    code = readme[readme.index("```python\n", start) + 10 : readme.index("```\n", start + 30)]
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {})
    lines = capsys.readouterr().out.splitlines()
    losses = [float(line.split()[-1]) for line in lines if line.startswith("step")]
    assert len(losses) == 5 and losses[-1] < losses[0] / 10
    assert lines[-1] == "1"  # one trace for every step
    saved = bp.load_tree(tmp_path / "checkpoint.npz")
    assert saved["opt_state"][1]["count"].item() == 201


@pytest.mark.parametrize(
    "make", [lambda: bp.optim.sgd(1.0, momentum=0.9), lambda: bp.optim.adam(0.1)]
)
def test_state_of_another_structure_is_refused_not_paired_by_position(make):
    """State built for {'b', 'a'} used with params {'a', 'b'}: zipped by position, each moment
    would update the other parameter."""
    opt = make()
    t = lambda v: bp.tensor(np.full(2, v, np.float32))  # noqa: E731
    reordered = {"b": t(0), "a": t(0)}
    _, state = opt.update({"b": t(1), "a": t(100)}, opt.init(reordered), reordered)
    with pytest.raises(TypeError, match=r"the same keys in another order \(\['b', 'a'\]"):
        opt.update({"a": t(0), "b": t(0)}, state, {"a": t(0), "b": t(0)})
    with pytest.raises(TypeError, match=r"keys only the first has: \['b'\]"):
        opt.update({"a": t(0)}, state, {"a": t(0)})
    listed = opt.init([t(0), t(0)])
    with pytest.raises(TypeError, match=r"at the top: a list of 2 against a dict of 2"):
        opt.update({"a": t(0), "b": t(0)}, listed, {"a": t(0), "b": t(0)})


def _ones(*shape):
    return bp.tensor(np.ones(shape, np.float32))


@pytest.mark.parametrize(
    "make, moment",
    [(lambda: bp.optim.adam(0.1), "mu"), (lambda: bp.optim.sgd(0.1, momentum=0.9), "momentum")],
)
def test_state_of_other_shapes_or_dtypes_is_refused_naming_the_leaf(make, moment):
    """A (2, 3) moment applied to a (3,) parameter broadcast and returned a (2, 3) parameter."""
    opt = make()
    wide = opt.init({"w": _ones(2, 3)})
    for shape in [(3,), (4,)]:  # one that broadcasts, one that does not
        with pytest.raises(TypeError, match=rf"state\['{moment}'\]\['w'\] is float32 \(2, 3\), "):
            opt.update({"w": _ones(*shape)}, wide, {"w": _ones(*shape)})
    doubles = opt.init({"w": bp.tensor(np.ones(3))})
    with pytest.raises(TypeError, match=r"\['w'\] is float64 \(3,\), but param \['w'\] is float32"):
        opt.update({"w": _ones(3)}, doubles, {"w": _ones(3)})


def test_float64_grads_on_float32_params_are_refused_as_torch_refuses_them():
    """Added in, they made the parameters float64 (and a compiled step then retraced)."""
    params = {"w": _ones(3)}
    opt = bp.optim.sgd(0.1)
    with pytest.raises(TypeError, match=r"grad \['w'\] is float64, param is float32.*astype"):
        opt.update({"w": bp.tensor(np.ones(3))}, opt.init(params), params)


def test_another_optimizers_state_is_refused_by_name_not_a_key_error():
    params = {"w": _ones(3)}
    with pytest.raises(TypeError, match=r"holds keys \['count'\], but .* \['count', 'mu', 'nu'\]"):
        bp.optim.adam(0.1).update(params, bp.optim.sgd(0.1).init(params), params)
    with pytest.raises(TypeError, match=r"holds a tuple"):
        bp.optim.sgd(0.1).update(params, (), params)


@pytest.mark.parametrize("lr", [float("nan"), float("inf"), -0.1, np.float32("nan")])
def test_learning_rates_that_are_not_finite_or_negative_are_refused(lr):
    for make in (bp.optim.sgd, bp.optim.adam, bp.optim.adamw):
        with pytest.raises(ValueError, match=r"lr must be (a finite number|at least 0)"):
            make(lr)


def test_a_traced_learning_rate_is_checked_on_every_call():
    """A Python float passed to a compiled step is traced (a new rate does not retrace), so the
    optimizer's check runs with each call's value, before the plan, naming the argument."""
    params = {"w": _ones(3)}

    @bp.compile
    def step(params, state, lr):
        grads = {"w": params["w"] * 2.0}
        return bp.optim.sgd(lr).update(grads, state, params)

    state = bp.optim.sgd(0.1).init(params)
    new, _ = step(params, state, 0.25)
    np.testing.assert_allclose(new["w"].numpy(), 0.5)
    for bad, said in ((-0.1, "lr must be at least 0, got -0.1"), (math.nan, "finite")):
        with pytest.raises(ValueError, match=said) as refused:
            step(params, state, bad)
        assert "argument lr of step(), a traced float" in str(refused.value)
    assert step(params, state, 0.5)[0]["w"].tolist() == [0.0, 0.0, 0.0]
    assert step.cache_info().traces == 1
    with pytest.raises(ValueError, match="lr must be at least 0"):
        bp.optim.sgd(bp.tensor(np.float32(-1.0)))  # a concrete scalar tensor: its value


def test_a_schedule_at_a_negative_step_is_refused():
    """warmup_linear(0.1, 10)(-5) was -0.05: a negative rate that ascends the loss."""
    for schedule in (bp.optim.warmup_linear(0.1, 10), bp.optim.cosine_decay(0.1, 10)):
        for step in (-5, bp.tensor(np.int64(-1))):
            with pytest.raises(ValueError, match="step count of at least 0, got -"):
                schedule(step)


def test_apply_updates_refuses_updates_that_do_not_fit_the_params():
    """bp.optim.apply_updates paired leaves by position: updates whose dict lists the same keys
    in another order added b's update to a, and one of another shape or dtype broadcast or
    widened the parameter, all without an error."""
    params = {"a": bp.tensor(np.zeros(2, np.float32)), "b": bp.tensor(np.zeros(2, np.float32))}
    ones = np.ones(2, np.float32)
    bad = {
        "the same keys in another order": {"b": bp.tensor(ones), "a": bp.tensor(5 * ones)},
        "update ['b'] is float32 (3, 2)": {"a": bp.tensor(ones), "b": np.ones((3, 2), np.float32)},
        "update ['a'] is float64 (2,)": {"a": bp.tensor(ones.astype(np.float64)), "b": ones},
        "update ['b'] is float": {"a": bp.tensor(ones), "b": 1.0},
    }
    for message, updates in bad.items():
        with pytest.raises(TypeError, match=re.escape(message)):
            bp.optim.apply_updates(params, updates)
    new = bp.optim.apply_updates(params, {"a": bp.tensor(ones), "b": 2 * ones})
    np.testing.assert_array_equal(new["b"].numpy(), 2 * ones)


def test_global_norm_of_a_tree_without_tensors_says_so():
    with pytest.raises(ValueError, match="global_norm: the tree holds no tensors"):
        bp.optim.global_norm({})
    assert float(bp.optim.global_norm([bp.tensor(np.array([3.0, 4.0]))]).numpy()) == 5.0


@pytest.mark.parametrize("lr", ["0.1", None, [0.1]])
def test_a_learning_rate_that_is_not_a_number_is_refused_naming_it(lr):
    """It failed inside the first update with "mul: expected a backplan tensor ... got a str"."""
    with pytest.raises(TypeError, match=r"bp\.optim\.sgd: lr must be a number, a tensor or a"):
        bp.optim.sgd(lr)
    with pytest.raises(TypeError, match=r"bp\.optim\.adam: eps must be a number"):
        bp.optim.adam(0.1, eps=lr)


def test_an_optimizer_with_a_schedule_is_named_by_the_schedule_in_errors():
    """Errors quote an optimizer's name; with a schedule it read
    'adamw(<function cosine_decay.<locals>.schedule at 0x7f...>)'."""
    schedule = bp.optim.cosine_decay(1e-2, 20)
    assert bp.optim.adamw(schedule).name == "adamw(cosine_decay(0.01, 20))"
    assert bp.optim.sgd(schedule, momentum=0.9).name == "sgd(cosine_decay(0.01, 20), momentum=0.9)"
    assert bp.optim.adam(1e-3).name == "adam(0.001)"
    with pytest.raises(ValueError, match=r"bp.optim.chain: adam\(cosine_decay\(0.01, 20\)\) has"):
        bp.optim.chain(bp.optim.adam(schedule, master_dtype=bp.float32))
