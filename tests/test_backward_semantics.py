"""The backward engine's semantics, each in eager and compiled form."""

import gc
import weakref

import numpy as np
import pytest

import backplan as bp
from backplan.ir.interpreter import run_plan

RNG = np.random.default_rng(1)


def mlp(w1, w2, x):
    return bp.sum(bp.tanh(bp.relu(x @ w1) @ w2))


compiled_mlp = bp.compile(mlp)


@pytest.fixture(params=["eager", "compiled"])
def model(request):
    """A compiled function of its own per test: after two backward() calls a compiled loss
    runs as one joint plan (runtime/joint_step.py), so a shared one would make what a test sees
    depend on the tests before it."""
    return mlp if request.param == "eager" else bp.compile(mlp)


def make_inputs():
    w1 = bp.tensor(RNG.standard_normal((4, 8)).astype(np.float32), requires_grad=True)
    w2 = bp.tensor(RNG.standard_normal((8, 3)).astype(np.float32), requires_grad=True)
    x = bp.tensor(RNG.standard_normal((5, 4)).astype(np.float32))
    return w1, w2, x


def reachable_regions(tensor):
    seen, stack = [], [tensor.grad_fn]
    while stack:
        region = stack.pop()
        if region is not None and all(region is not r for r in seen):
            seen.append(region)
            stack.extend(region.next_regions)
    return seen


def test_backward_never_builds_or_changes_the_graph(model):
    w1, w2, x = make_inputs()
    out = model(w1, w2, x)
    regions = reachable_regions(out)
    plans_before = [
        (r.program.plans.backward.text(), [e.region for e in r.input_edges]) for r in regions
    ]
    out.backward(retain_graph=True)
    out.backward()
    assert reachable_regions(out) == regions
    plans_after = [
        (r.program.plans.backward.text(), [e.region for e in r.input_edges]) for r in regions
    ]
    assert plans_after == plans_before


def test_each_saved_buffer_dies_right_after_its_last_read():
    """Watch every saved buffer through a weak reference at every backward step."""
    w1, w2, x = make_inputs()
    out = compiled_mlp(w1, w2, x)
    region = out.grad_fn
    program = region.program
    infos = program.saved_info
    refs = {
        info.slot: weakref.ref(region._saved[info.slot])
        for info in infos
        if not info.is_region_input
    }
    alive_at: dict[int, list[int]] = {slot: [] for slot in refs}

    def record(step, env):
        for slot, ref in refs.items():
            if ref() is not None:
                alive_at[slot].append(step)

    program.run_backward = lambda args, mode, release: run_plan(
        program.plans.backward, args, release=release, on_step=record
    )
    out.backward()
    assert refs, "the plan should save intermediates"
    for info in infos:
        if info.slot in refs:
            assert max(alive_at[info.slot]) == info.last_read_step, info
            assert refs[info.slot]() is None
    np.testing.assert_array_equal(x.numpy(), x.numpy())  # x stays valid for its owner


def test_retain_graph_keeps_buffers_and_gives_identical_gradients(model):
    w1, w2, x = make_inputs()
    out = model(w1, w2, x)
    out.backward(retain_graph=True)
    first = w1.grad.numpy().copy()
    bp.zero_grad([w1, w2])
    out.backward(retain_graph=True)
    np.testing.assert_array_equal(w1.grad.numpy(), first)
    out.backward()
    np.testing.assert_allclose(w1.grad.numpy(), 2 * first, rtol=1e-6)


def test_gradients_accumulate_and_zero_grad_clears_them(model):
    w1, w2, x = make_inputs()
    model(w1, w2, x).backward()
    once = w1.grad.numpy().copy()
    model(w1, w2, x).backward()
    np.testing.assert_allclose(w1.grad.numpy(), 2 * once, rtol=1e-6)
    bp.zero_grad({"layers": [w1, w2]})
    assert w1.grad is None and w2.grad is None


def test_no_grad_and_inputs_without_grad_save_nothing(model):
    w1, w2, x = make_inputs()
    with bp.no_grad():
        out = model(w1, w2, x)
        assert not bp.is_grad_enabled()
    assert bp.is_grad_enabled()
    assert out.grad_fn is None and not out.requires_grad and bp.live_saved_bytes() == 0
    plain = [bp.tensor(t.numpy()) for t in (w1, w2, x)]
    out = model(*plain)
    assert out.grad_fn is None and bp.live_saved_bytes() == 0
    with pytest.raises(bp.BackwardError, match="does not require grad"):
        out.backward()


def test_detach_cuts_the_graph_inside_and_outside_compile():
    w1, w2, x = make_inputs()

    @bp.compile
    def half_detached(w1, w2, x):
        hidden = bp.relu(x @ w1)
        return bp.sum(hidden.detach() @ w2)

    half_detached(w1, w2, x).backward()
    assert w1.grad is None and w2.grad is not None
    hidden = bp.relu(x @ w1).detach()
    assert hidden.grad_fn is None and not hidden.requires_grad


def test_live_saved_bytes_counts_every_graph_and_drops_to_zero(model):
    w1, w2, x = make_inputs()
    assert bp.live_saved_bytes() == 0
    out = model(w1, w2, x)
    distinct = []  # each saved array once, however many regions save it
    for array in (a for r in reachable_regions(out) for a in r._saved.values()):
        if not any(np.shares_memory(array, b) and array.nbytes == b.nbytes for b in distinct):
            distinct.append(array)
    yours = [a for a in distinct if any(np.shares_memory(a, t._data) for t in (w1, w2, x))]
    assert bp.live_saved_bytes(yours=True) == sum(a.nbytes for a in yours) > 0
    assert (
        bp.live_saved_bytes() == sum(a.nbytes for a in distinct) - sum(a.nbytes for a in yours) > 0
    )
    out.backward()
    assert bp.live_saved_bytes() == 0 == bp.live_saved_bytes(yours=True)


def test_live_saved_bytes_of_a_joint_call_counts_the_gradients_and_inputs_it_holds():
    w1, w2, x = make_inputs()
    model = bp.compile(mlp)
    for _ in range(2):  # two calls backward()ed from the default seed: the third runs joint
        model(w1, w2, x).backward()
    out = model(w1, w2, x)
    assert "joint plan" in repr(out.grad_fn)
    gradients = w1.numpy().nbytes + w2.numpy().nbytes
    assert bp.live_saved_bytes() == gradients
    assert bp.live_saved_bytes(yours=True) == sum(t.numpy().nbytes for t in (w1, w2, x))
    out.backward()
    assert bp.live_saved_bytes() == 0 == bp.live_saved_bytes(yours=True)


def test_saved_buffer_facts_name_producer_readers_and_lines():
    w1, w2, x = make_inputs()
    out = compiled_mlp(w1, w2, x)
    by_op = {b.op: b for b in out.grad_fn.saved_buffers}
    tanh = by_op["tanh"]
    assert tanh.shape == (5, 3) and tanh.nbytes == 60
    assert isinstance(tanh.dtype, np.dtype) and tanh.dtype == np.float32 == x.dtype
    assert tanh.produced_at.startswith("test_backward_semantics.py:")
    assert tanh.reason == "tanh derivative reads its output"
    assert any(r.startswith("mul at test_backward_semantics.py:") for r in tanh.read_by)
    assert not tanh.freed
    table = str(out.grad_fn)
    assert "tanh at test_backward_semantics.py" in table and "alive" in table
    out.backward()
    assert all(b.freed for b in out.grad_fn.saved_buffers)
    assert "freed" in str(out.grad_fn)


def test_backward_misuse_errors():
    w1, w2, x = make_inputs()
    hidden = bp.relu(x @ w1)
    with pytest.raises(bp.BackwardError, match=r"non-scalar tensor of shape \(5, 8\)"):
        hidden.backward()
    with pytest.raises(bp.BackwardError, match="create_graph"):
        bp.sum(hidden).backward(create_graph=True)
    with pytest.raises(bp.BackwardError, match="gradient has shape"):
        hidden.backward(np.ones((2, 2), np.float32))
    with pytest.raises(bp.BackwardError, match="only float tensors"):
        bp.tensor([1, 2], requires_grad=True)


def test_unreferenced_graphs_are_released():
    w1, w2, x = make_inputs()
    out = compiled_mlp(w1, w2, x)
    region = weakref.ref(out.grad_fn)
    del out
    gc.collect()
    assert region() is None and bp.live_saved_bytes() == 0
