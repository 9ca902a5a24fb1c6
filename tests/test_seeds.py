"""Every scenario from the forum threads backplan exists to answer, as backplan behaviour.

Each test names the question it answers. Eager and compiled variants run the same scenario.
"""

import gc
import weakref

import numpy as np
import pytest
from helpers import here, line_of

import backplan as bp

RNG = np.random.default_rng(0)


def linear_params(n_in=3, n_out=3):
    w = bp.tensor(RNG.standard_normal((n_in, n_out)).astype(np.float32), requires_grad=True)
    b = bp.tensor(RNG.standard_normal(n_out).astype(np.float32), requires_grad=True)
    return w, b


def linear(params, x):
    w, b = params
    return x @ w + b


compiled_linear = bp.compile(linear)


@pytest.fixture(params=["eager", "compiled"])
def layer(request):
    return linear if request.param == "eager" else compiled_linear


def test_graph_rebuilt_each_iteration_allows_backward_every_time(layer):
    """Seed 0, example 1: the forward inside the loop builds a new graph each time."""
    params = linear_params()
    a = bp.tensor(RNG.standard_normal((4, 3)).astype(np.float32))
    for _ in range(5):
        y = bp.sum(layer(params, a))
        y.backward()
    expected_w = 5 * a.numpy().T @ np.ones((4, 3), np.float32)
    np.testing.assert_allclose(params[0].grad.numpy(), expected_w, rtol=1e-5)
    assert bp.live_saved_bytes() == 0


def test_backward_twice_on_same_output_raises_and_names_both_lines(layer):
    """Seed 0, example 2: y built once, backward in a loop: the second call fails, always."""
    params = linear_params()
    a = bp.tensor(RNG.standard_normal((4, 3)).astype(np.float32))
    y = bp.sum(layer(params, a))
    y.backward()
    first = here(offset=-1)  # the backward() line above
    grad_after_first = params[0].grad.numpy().copy()
    second = here(offset=2)
    with pytest.raises(bp.GraphFreedError) as info:
        y.backward()
    message = str(info.value)
    assert f"backward() at {second} reaches region `sum`" in message
    assert "second backward() through the same graph" in message
    assert f"Fix: pass retain_graph=True to the backward() at {first}" in message
    assert "loop" not in message and "detach" not in message and "shared" not in message
    assert info.value.facts.case == "same graph" and info.value.facts.saved_buffers == 0
    np.testing.assert_array_equal(params[0].grad.numpy(), grad_after_first)  # nothing half-done


def test_reused_intermediate_outside_loop_is_a_shared_region(layer):
    """Seed 0: x_out = x(a) outside the loop, y = sum(x_out) inside: the second backward fails
    and the message says the region is shared with an earlier graph."""
    params = linear_params()
    a = bp.tensor(RNG.standard_normal((4, 3)).astype(np.float32), requires_grad=True)
    x_out = layer(params, a)
    made = here(offset=-1)
    for i in range(2):
        y = bp.sum(x_out)
        loop_line = here(offset=-1)
        if i == 0:
            y.backward()
            first = here(offset=-1)
    with pytest.raises(bp.GraphFreedError) as info:
        y.backward()
    message, facts = str(info.value), info.value.facts
    assert facts.case == "shared" and facts.loop and facts.freed_by == first
    assert facts.created_at.startswith(made)
    assert "The region is shared" in message
    assert f"Both graphs were built by the same line, {loop_line}, as in a loop" in message
    assert f"Fix: compute it inside the loop (move the line {made}" in message
    assert ".detach()" in message


def test_region_that_saved_nothing_still_raises_on_second_backward():
    """Seed 0 and 1: `c = a * 5` saves nothing (the constant is rebuilt, not saved); PyTorch's
    second backward may or may not fail depending on that. backplan always fails."""
    a = bp.tensor(2.0, requires_grad=True)
    c = a * 5
    assert c.grad_fn.saved_buffers == []
    c.backward()
    with pytest.raises(bp.GraphFreedError, match="second backward"):
        c.backward()
    assert a.grad.item() == 5.0


def test_mean_then_add_graph_fails_deterministically_unlike_torch():
    """Seed 1, question 1: y = x.mean(1).squeeze() + 3; z = y.pow(2).mean(). After
    y.backward(), z.backward() goes through y's freed regions: always an error."""
    x = bp.tensor(np.ones((2, 3), np.float32), requires_grad=True)
    y = x.mean(axis=1).squeeze() + 3
    z = (y**2).mean()
    y.backward(np.ones(2, np.float32))
    with pytest.raises(bp.GraphFreedError):
        z.backward()
    with pytest.raises(bp.GraphFreedError):
        y.backward(np.ones(2, np.float32))


def test_retain_graph_keeps_every_saved_buffer_for_later_backwards(layer):
    """Seed 0, question 3: how do we keep the buffers? retain_graph=True."""
    params = linear_params()
    a = bp.tensor(RNG.standard_normal((4, 3)).astype(np.float32), requires_grad=True)
    y = bp.sum(bp.tanh(layer(params, a)))
    held = bp.live_saved_bytes()
    assert held > 0
    for _ in range(3):
        y.backward(retain_graph=True)
        assert bp.live_saved_bytes() == held
    single = params[0].grad.numpy() / 3
    y.backward()
    np.testing.assert_allclose(params[0].grad.numpy(), 4 * single, rtol=1e-5)
    assert bp.live_saved_bytes() == 0


def test_freed_means_the_graph_drops_its_reference_only():
    """Seed 0, question 1: freeing drops the graph's reference; the user's stays valid, and a
    buffer nobody else holds really dies."""
    x = bp.tensor(RNG.standard_normal(5).astype(np.float32), requires_grad=True)
    w = bp.tensor(RNG.standard_normal(5).astype(np.float32))
    h = bp.tanh(x * w)
    out = bp.sum(h * w)
    tanh_region = h.grad_fn
    saved_tanh = weakref.ref(tanh_region._saved[0])
    del h
    out.backward()
    gc.collect()
    assert saved_tanh() is None  # only the graph held tanh's output: gone
    assert all(b.freed for b in tanh_region.saved_buffers)
    np.testing.assert_array_equal(w.numpy(), w.numpy())  # the user's w is still valid
    assert w.numpy().shape == (5,)


def test_mul_saves_only_the_operand_the_other_side_needs():
    """Seed 0: mul's derivative needs `other` for self's gradient: only that is saved."""
    self_ = bp.tensor(RNG.standard_normal(10).astype(np.float32), requires_grad=True)
    other = bp.tensor(RNG.standard_normal(10).astype(np.float32))
    out = self_ * other
    (saved,) = out.grad_fn.saved_buffers
    assert saved.shape == (10,) and saved.reason == "mul derivative reads input 1"
    assert saved.nbytes == 40 and not saved.freed
    both = bp.tensor(RNG.standard_normal(10).astype(np.float32), requires_grad=True) * self_
    assert len(both.grad_fn.saved_buffers) == 2


def test_saved_buffers_cannot_be_modified_behind_the_graphs_back():
    """Seed 0: the 'modify it in place and see if backward fails' trick cannot corrupt a graph:
    tensors are immutable and their arrays read-only."""
    other = bp.tensor(np.ones(3, np.float32))
    with pytest.raises(TypeError, match="immutable"):
        other[0] = 5.0
    with pytest.raises(ValueError):
        other.numpy()[0] = 5.0


def test_which_intermediates_are_freed_linear_times_five():
    """Seed 0, last question: a -> Linear -> *5 -> sum: which values does backward free?"""
    a = bp.tensor([[2.0], [3.0]], requires_grad=True)
    w, b = linear_params(1, 3)

    @bp.compile
    def model(a, w, b):
        y = a @ w + b
        z = y * 5
        return bp.sum(z)

    o = model(a, w, b)
    names = {(s.op, s.reason) for s in o.grad_fn.saved_buffers}
    assert names == {
        ("input", "matmul derivative reads input 0"),
        ("input", "matmul derivative reads input 1"),
    }
    o.backward()
    assert all(s.freed for s in o.grad_fn.saved_buffers)
    assert a.numpy().shape == (2, 1)  # the user's tensors remain


def test_same_net_twice_on_same_input_builds_two_independent_regions(layer):
    """Seed 1, question 2: each forward builds its own graph with its own saved buffers."""
    params = linear_params()
    inp = bp.tensor(RNG.standard_normal((2, 3)).astype(np.float32))
    out1 = bp.sum(bp.tanh(layer(params, inp)))
    out2 = bp.sum(bp.tanh(layer(params, inp)))
    assert out1.grad_fn is not out2.grad_fn
    held = bp.live_saved_bytes()
    out1.backward()
    assert 0 < bp.live_saved_bytes() < held
    out2.backward()  # unaffected by out1's backward
    assert bp.live_saved_bytes() == 0


def test_forward_without_backward_holds_buffers_until_outputs_die():
    """Seed 1: a forward-only pass with grad enabled keeps its state until the output goes out
    of scope; under no_grad nothing is kept at all."""
    params = linear_params()
    inp = bp.tensor(RNG.standard_normal((2, 3)).astype(np.float32))
    out = bp.tanh(compiled_linear(params, inp))
    assert bp.live_saved_bytes() > 0
    region = weakref.ref(out.grad_fn)
    del out
    gc.collect()
    assert region() is None and bp.live_saved_bytes() == 0
    with bp.no_grad():
        out = bp.tanh(compiled_linear(params, inp))
    assert out.grad_fn is None and not out.requires_grad and bp.live_saved_bytes() == 0


def test_detach_before_discriminator_stops_gradient_to_generator():
    """Seed 1, GAN question: D(fake.detach()) trains D only; requires_grad=False on D's
    parameters still lets the gradient reach G through D."""
    g_params = linear_params()
    d_params = linear_params()
    z = bp.tensor(RNG.standard_normal((4, 3)).astype(np.float32))
    fake = compiled_linear(g_params, z)
    bp.sum(compiled_linear(d_params, fake.detach())).backward()
    assert g_params[0].grad is None and d_params[0].grad is not None

    frozen = tuple(bp.tensor(p.numpy()) for p in d_params)
    fake = compiled_linear(g_params, z)
    bp.sum(compiled_linear(frozen, fake)).backward()
    assert g_params[0].grad is not None and frozen[0].grad is None


def shared_subgraph_setup():
    x = bp.tensor([1.0, 0.0], dtype="float64")
    t = bp.tensor(np.eye(2), requires_grad=True)
    a = bp.tensor(np.ones(2), requires_grad=True)
    return x, t, a


def test_shared_subgraph_across_loop_iterations_raises_naming_the_shared_region():
    """Seed 2: y = t @ a once, reused in every iteration: the second backward raises and says
    y's region is shared with an earlier graph, naming the line that made it."""
    x, t, a = shared_subgraph_setup()
    y = t @ a
    y_line = here(offset=-1)  # the line that computed y
    for i in range(2):
        x_out = t @ (x + y)
        loss = bp.mse_loss(x_out, x)
        if i == 0:
            loss.backward()
        else:
            with pytest.raises(bp.GraphFreedError) as info:
                loss.backward()
    message, facts = str(info.value), info.value.facts
    assert facts.region == "matmul [reshape]" and facts.created_at == y_line
    assert facts.more_freed == ("matmul", "matmul [reshape]")
    assert f"created at {y_line}" in message and "The region is shared" in message
    assert "(2 saved buffers, 48 B)" in message  # t f64[2,2] and a as f64[2,1]
    assert "as in a loop" in message and f"move the line {y_line} into it" in message


def test_shared_subgraph_with_retain_graph_works_and_releases_tails_then_rest():
    """Seed 2, follow-ups: retain_graph=True works; each iteration's tail is released when its
    last reference goes; `del y` releases the shared part."""
    x, t, a = shared_subgraph_setup()
    y = t @ a
    shared = weakref.ref(y.grad_fn)
    tails = []
    for _ in range(3):
        x_out = t @ (x + y)
        loss = bp.mse_loss(x_out, x)
        loss.backward(retain_graph=True)
        tails.append(weakref.ref(loss.grad_fn))
    expected = 3 * bp.grad(lambda t, a: bp.mse_loss(t @ (x + t @ a), x))(t, a).numpy()
    np.testing.assert_allclose(t.grad.numpy(), expected, rtol=1e-10)
    del x_out, loss
    gc.collect()
    assert all(tail() is None for tail in tails)
    assert shared() is not None and bp.live_saved_bytes() > 0
    del y
    gc.collect()
    assert shared() is None and bp.live_saved_bytes() == 0


def test_tensors_stay_usable_for_new_forward_ops_after_backward():
    """Seed 2: after c.backward(), b and c can still be used in new forward computations; only
    backward through the freed regions fails."""
    a = bp.tensor(1.0, requires_grad=True)
    b = a * bp.tensor(2.0)
    c = b * bp.tensor(3.0)
    c.backward()
    d = b * bp.tensor(4.0)
    e = c * bp.tensor(5.0)
    assert d.item() == 8.0 and e.item() == 30.0
    with pytest.raises(bp.GraphFreedError):
        e.backward()


def test_deleting_an_operand_does_not_touch_the_graphs_saved_copy():
    """Seed 2: c = a * b; del b; c.backward(retain_graph=True) three times works: the graph
    holds its own reference to b."""
    a = bp.tensor(1.0, requires_grad=True)
    b = bp.tensor(2.0, requires_grad=True)
    c = a * b
    del b
    for _ in range(3):
        c.backward(retain_graph=True)
    assert a.grad.item() == 6.0


def test_graph_stays_reachable_after_backward_until_detached():
    """Seed 3: after k.backward() the freed graph hangs on k (and on m = k); m = k.detach()
    drops it so it is garbage collected."""
    x = bp.tensor([3.0], requires_grad=True)
    k = x * 2
    k.backward(np.ones(1, np.float32))
    m = k
    assert m.requires_grad and m.grad_fn is not None and m.grad_fn.freed
    region = weakref.ref(k.grad_fn)
    m = k.detach()
    del k
    gc.collect()
    assert region() is None
    assert not m.requires_grad and m.grad_fn is None and m.item() == 6.0


# ---- one call answers each thread: o.graph(), eager and compiled ------------------------------


def linear_times_five_sum(a, w, b):
    y = a @ w + b
    return bp.sum(y * 5)


def test_seed0_graph_lists_every_region_backward_frees_with_bytes_and_state(layer):
    """Seed 0, last question: a -> Linear -> *5 -> sum: o.graph() names each region o.backward()
    runs, what each holds, and after backward which backward() freed it."""
    a = bp.tensor([[2.0], [3.0]], requires_grad=True)
    w, b = linear_params(1, 3)
    fn = linear_times_five_sum if layer is linear else bp.compile(linear_times_five_sum)
    o = fn(a, w, b)
    made = here(offset=-1)
    report = o.graph()
    names = [r.name for r in report.regions]
    if layer is linear:
        assert names == ["sum", "mul", "add", "matmul"]
    else:
        assert names == ["linear_times_five_sum"]
    assert report.saved_bytes == 0  # the graph allocated nothing it saves
    assert report.input_bytes == 8 + 12  # a f32[2,1] and w f32[1,3], yours, held by reference
    text = str(report)
    assert f"graph of `{names[0]}` (created at {made}" in text
    assert "total: 2 saved buffers, each array once: 0 B allocated by the graph, 20 B your" in text
    o.backward()
    freed_at = here(offset=-1)
    report = o.graph()
    assert report.saved_bytes == 0 and len(report.freed_regions) == len(names)
    text = str(report)
    assert text.count(f"freed by the backward() at {freed_at}") == len(names)
    assert "backward() raises GraphFreedError at region 1" in text


def test_seed0_a_times_five_saved_nothing_and_says_the_graph_was_released():
    """Seed 0: `c = a * 5; c.backward(); c.backward()`: the region saved nothing, so the words
    are "the graph was released", never "saved buffers were freed"."""
    a = bp.tensor(2.0, requires_grad=True)
    c = a * 5
    assert "`mul` created at" in str(c.graph()) and "saved nothing; alive" in str(c.graph())
    c.backward()
    first = here(offset=-1)
    with pytest.raises(bp.GraphFreedError) as info:
        c.backward()
    message = str(info.value)
    assert f"It saved nothing, but the graph was released by the backward() at {first}" in message
    assert "saved buffer" not in message and "loop" not in message


def test_seed0_graph_built_in_a_helper_names_the_callers_line_and_the_helper():
    """Seed 0: the user looks at the line that called their helper; the helper's line follows."""
    params = linear_params()
    a = bp.tensor(RNG.standard_normal((4, 3)).astype(np.float32), requires_grad=True)
    out = linear(params, a)
    called = here(offset=-1)
    helper = f"test_seeds.py:{line_of('return x @ w + b', __file__)}"
    assert out.grad_fn.created_at == f"{called} (via linear at {helper})"
    saved = out.graph().regions[1].saved_buffers  # matmul's, read through add
    assert {s.produced_at for s in saved if not s.is_region_input} <= {out.grad_fn.created_at}
    bp.sum(out).backward()
    with pytest.raises(bp.GraphFreedError) as info:
        bp.sum(out).backward()
    assert f"(created at {called} (via linear at {helper}))" in str(info.value)


def mean_plus_three(x):
    return x.mean(axis=1).squeeze() + 3


def mean_of_square(y):
    return (y**2).mean()


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_seed1_second_backward_through_shared_regions_always_fails_and_says_why(mode):
    """Seed 1, question 1: y.backward(ones) then z.backward(), z built on y. No loop here, so
    the message never mentions one; it names y's region, the backward that freed it, and that
    z's graph is built on it."""
    f, g = (
        (mean_plus_three, mean_of_square)
        if mode == "eager"
        else (bp.compile(mean_plus_three), bp.compile(mean_of_square))
    )
    x = bp.tensor(np.ones((2, 3), np.float32), requires_grad=True)
    y = f(x)
    y_line = here(offset=-1)
    z = g(y)
    z_line = here(offset=-1)
    assert [r.name for r in z.graph().regions][-1] == (
        "mean [sum]" if mode == "eager" else "mean_plus_three"
    )
    y.backward(np.ones(2, np.float32))
    first = here(offset=-1)
    with pytest.raises(bp.GraphFreedError) as info:
        z.backward()
    message, facts = str(info.value), info.value.facts
    assert facts.case == "shared" and not facts.loop and facts.freed_by == first
    assert facts.created_at.startswith(y_line) and facts.saved_buffers == 0
    assert "It saved nothing, but the graph was released" in message
    assert "the graph you differentiate now starts from `" in message and z_line in message
    assert "loop" not in message
    assert f"Fix: pass retain_graph=True to the backward() at {first}" in message


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_seed2_shared_subgraph_graph_shows_shared_part_and_its_bytes(mode):
    """Seed 2: y = t @ a once, loss built on it per iteration: loss.graph() shows the loss's
    own regions, then y's, with what y's matmul holds; with retain_graph they stay alive."""
    x, t, a = shared_subgraph_setup()

    def step(t, x, y):
        return bp.mse_loss(t @ (x + y), x)

    def product(t, a):
        return t @ a

    if mode == "compiled":
        step, product = bp.compile(step), bp.compile(product)
    y = product(t, a)
    y_line = here(offset=-1)
    loss = step(t, x, y)
    report = loss.graph()
    shared = [r for r in report.regions if r.created_at.startswith(y_line)]
    assert [r.freed for r in shared] == [False] * len(shared)
    assert sum(r.saved_bytes for r in shared) == 32 + 16  # t f64[2,2], a as f64[2,1]
    if mode == "eager":
        assert [r.name for r in shared] == ["matmul [reshape]", "matmul", "matmul [reshape]"]
        assert report.regions[0].name == "mse_loss [mul]"
    loss.backward(retain_graph=True)
    assert not loss.graph().freed_regions
    loss.backward()
    freed_at = here(offset=-1)
    loss = step(t, x, y)
    with pytest.raises(bp.GraphFreedError) as info:
        loss.backward()
    facts = info.value.facts
    assert facts.case == "shared" and facts.freed_by == freed_at
    assert facts.created_at.startswith(y_line)
    assert not facts.loop  # the two losses came from different lines


@pytest.mark.reference
def test_seed2_compiled_loop_reusing_y_names_the_loop():
    """Seed 2, compiled: the loop's line built both graphs; the fix moves y's line into it."""
    x, t, a = shared_subgraph_setup()
    product = bp.compile(lambda t, a: t @ a)
    step = bp.compile(lambda t, x, y: bp.mse_loss(t @ (x + y), x))
    y = product(t, a)
    y_line = here(offset=-1)
    for i in range(2):
        loss = step(t, x, y)
        loop_line = here(offset=-1)
        if i == 0:
            loss.backward()
    with pytest.raises(bp.GraphFreedError) as info:
        loss.backward()
    message, facts = str(info.value), info.value.facts
    assert facts.loop and facts.region == "<lambda>" and facts.saved_buffers == 2
    assert "whose 2 saved buffers (48 B) the backward() at" in message
    assert f"built by the same line, {loop_line}, as in a loop" in message
    assert f"move the line {y_line} into it" in message


def test_seed3_freed_graph_stays_on_the_tensor_until_detached(layer):
    """Seed 3: after k.backward() the graph hangs on k with nothing in it; k.graph() says so;
    k.detach() has no graph at all."""
    x = bp.tensor([3.0], requires_grad=True)
    k = x * 2 if layer is linear else bp.compile(lambda x: x * 2)(x)
    k.backward(np.ones(1, np.float32))
    freed_at = here(offset=-1)
    text = str(k.graph())
    assert f"saved nothing; freed by the backward() at {freed_at}" in text
    assert "held now: 0 B allocated, 0 B yours" in text
    assert str(k.detach().graph()) == "graph: a tensor that does not require grad: it has no graph"
    assert "leaf tensor" in str(bp.explain_graph(x))


def test_no_grad_retrace_is_named_in_cache_info():
    """Seed 1: a forward under no_grad is its own plan: cache_info says why it retraced."""
    fn = bp.compile(linear)
    params = linear_params()
    inp = bp.tensor(RNG.standard_normal((2, 3)).astype(np.float32))
    fn(params, inp)
    with bp.no_grad():
        fn(params, inp)
        fn(params, inp)
    info = fn.cache_info()
    assert info.traces == 2 and info.hits == 1
    assert "requires_grad True -> False" in info.last_miss_reason
    assert "bp.no_grad() is on: a forward-only plan" in info.last_miss_reason
