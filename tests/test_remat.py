"""Rematerialisation: cheap chains are recomputed in backward instead of saved, saved bytes go
down, gradients stay equal; a saved budget the default plan meets runs it."""

import numpy as np

import backplan as bp


def ln_gelu(x, g, b):
    y = bp.gelu(bp.layer_norm(x) * g + b, approximate="tanh") + x
    return bp.sum(y * bp.tensor(np.linspace(-1, 1, x.shape[-1]).astype(np.float32)))


def inputs():
    rng = np.random.default_rng(0)
    return (
        bp.tensor(rng.standard_normal((6, 8)).astype(np.float32), requires_grad=True),
        bp.tensor(rng.standard_normal(8).astype(np.float32), requires_grad=True),
        bp.tensor(rng.standard_normal(8).astype(np.float32), requires_grad=True),
    )


def intermediate_bytes(program):
    return sum(i.nbytes for i in program.saved_info if not i.is_region_input)


def test_layer_norm_gelu_saves_only_its_inputs_and_gradients_match():
    args = inputs()
    saving = bp.compile(remat=False)(ln_gelu)
    recomputing = bp.compile(ln_gelu)
    assert intermediate_bytes(saving.trace(*args).program) == 2 * 6 * 8 * 4
    program = recomputing.trace(*args).program
    assert intermediate_bytes(program) == 0
    # compiled plans run layer_norm as primitives: its value is the last mul of that chain
    chains = {r.chain[-1].op: [n.op for n in r.chain] for r in program.plans.recomputed}
    assert chains["add"] == ["mul", "add"] and "sqrt" in chains["mul"]
    grads = []
    for fn in (saving, recomputing):
        bp.zero_grad(args)
        fn(*args).backward()
        grads.append([a.grad.numpy().copy() for a in args])
    for a, b in zip(*grads, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)


def test_a_saved_budget_the_default_plan_meets_runs_the_default_plan():
    """The budget no longer stops the cheap recomputation early (that plan, saving more than
    the default, could peak above a larger budget's): a budget the default plan meets runs it."""
    args = inputs()
    program = bp.compile(saved_bytes_budget=6 * 8 * 4)(ln_gelu).trace(*args).program
    default = bp.compile(ln_gelu).trace(*args).program
    assert intermediate_bytes(program) == intermediate_bytes(default) == 0
    assert len(program.plans.recomputed) == len(default.plans.recomputed) == 2


def test_values_behind_an_expensive_op_stay_saved():
    rng = np.random.default_rng(1)
    w = bp.tensor(rng.standard_normal((8, 8)).astype(np.float32), requires_grad=True)
    x = bp.tensor(rng.standard_normal((4, 8)).astype(np.float32))
    fn = bp.compile(lambda w, x: bp.sum(bp.tanh(x @ w) @ w))
    program = fn.trace(w, x).program
    assert program.plans.recomputed == []
    assert any(i.op == "tanh" for i in program.saved_info)


def test_every_saved_and_recomputed_record_carries_a_numpy_dtype():
    """Records use the dtype Tensor.dtype uses (np.dtype(buf.dtype) works); tables print the
    short IR name."""
    args = inputs()
    x64 = bp.tensor(np.ones((6, 8)), requires_grad=True)
    compiled = bp.compile(ln_gelu)
    report = bp.explain(compiled, *args)
    joint = bp.explain(bp.value_and_grad(compiled), *args)
    out = bp.compile(lambda x: bp.sum(bp.tanh(x)))(x64)
    records = [*report.saved_buffers, *report.recomputed, *joint.saved_buffers]
    records += out.grad_fn.saved_buffers
    assert report.recomputed and joint.saved_buffers and out.grad_fn.saved_buffers
    for record in records:
        assert isinstance(record.dtype, np.dtype), record
        assert np.dtype(record.dtype) == record.dtype
    assert {r.dtype for r in records} == {np.dtype(np.float32), np.dtype(np.float64)}
    assert out.grad_fn.saved_buffers[0].dtype == x64.dtype
    assert "f64[6,8]" in str(out.grad_fn) and "f32[6,8]" in str(report)


def gelu_mlp(w1, w2, x):
    return bp.sum(bp.gelu(x @ w1, approximate="tanh") @ w2)


def test_joint_plan_holds_only_the_matmul_result_and_tanh_of_an_expanded_gelu():
    """value_and_grad expands tanh-gelu into primitives so forward and gradient share one
    tanh; the cheap pieces (x*x, 0.5*x, 1+tanh, the output) are copied into the gradient part
    instead of held across, so it holds what `bp.compile`'s plans save, and no more."""
    rng = np.random.default_rng(3)
    w1, w2, x = (
        bp.tensor(rng.standard_normal(shape).astype(np.float32))
        for shape in ((7, 33), (33, 5), (4, 7))
    )
    vg = bp.value_and_grad(gelu_mlp, argnums=(0, 1))
    report = bp.explain(vg, w1, w2, x)
    held = {(i.op, i.shape) for i in report.saved_buffers if not i.is_region_input}
    assert held == {("matmul", (4, 33)), ("tanh", (4, 33))}
    value, (g1, g2) = vg(w1, w2, x)
    x64, w164, w264 = (t.numpy().astype(np.float64) for t in (x, w1, w2))
    h = x64 @ w164
    t = np.tanh(0.7978845608028654 * (h + 0.044715 * h**3))
    expected = np.sum((0.5 * h * (1 + t)) @ w264)
    np.testing.assert_allclose(value.numpy(), expected, rtol=1e-5)
    upstream = np.ones((4, 5)) @ w264.T  # d loss / d gelu(h)
    inner_grad = 0.7978845608028654 * (1 + 3 * 0.044715 * h**2)
    dgelu = 0.5 * (1 + t) + 0.5 * h * (1 - t**2) * inner_grad
    np.testing.assert_allclose(g2.numpy(), (0.5 * h * (1 + t)).T @ np.ones((4, 5)), rtol=1e-4)
    np.testing.assert_allclose(g1.numpy(), x64.T @ (upstream * dgelu), rtol=1e-4, atol=1e-5)
