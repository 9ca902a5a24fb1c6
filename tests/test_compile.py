"""@compile: tracing, the signature cache and retrace reasons, tracing errors, nesting, and the
functional API."""

import numpy as np
import pytest
from helpers import here

import backplan as bp

RNG = np.random.default_rng(2)


def f32(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def test_pytrees_in_and_out_and_static_arguments():
    @bp.compile
    def step(params, batch, scale):
        h = batch["x"] @ params["w"][0] + params["w"][1]
        return {"loss": bp.sum(h * h) * scale, "parts": (h, scale)}

    params = {"w": [bp.tensor(f32(3, 2), requires_grad=True), bp.tensor(f32(2))]}
    batch = {"x": bp.tensor(f32(4, 3))}
    out = step(params, batch, 0.5)
    h = batch["x"].numpy() @ params["w"][0].numpy() + params["w"][1].numpy()
    np.testing.assert_allclose(out["loss"].numpy(), 0.5 * np.sum(h * h), rtol=1e-5)
    assert out["parts"][1] == 0.5 and out["parts"][0].shape == (4, 2)
    out["loss"].backward()
    np.testing.assert_allclose(params["w"][0].grad.numpy(), batch["x"].numpy().T @ h, rtol=1e-5)
    assert params["w"][1].grad is None  # it does not require grad


def test_cache_hits_and_every_kind_of_miss_is_explained():
    @bp.compile(dynamic=False)  # every size its own signature (else axis 0 turns dynamic)
    def fn(x, scale=1):
        return bp.sum(x) * scale

    x = bp.tensor(f32(4, 3))
    fn(x)
    fn(bp.tensor(f32(4, 3)))
    info = fn.cache_info()
    assert (info.traces, info.hits, info.misses) == (1, 1, 1)
    assert info.last_miss_reason == "first call"
    fn(bp.tensor(f32(2, 3)))
    assert fn.cache_info().last_miss_reason == "x: shape (4, 3) -> (2, 3)"
    fn(bp.tensor(f32(2, 3).astype(np.float64)))
    assert fn.cache_info().last_miss_reason == "x: dtype f32 -> f64"
    fn(bp.tensor(f32(2, 3).astype(np.float64), requires_grad=True))
    assert fn.cache_info().last_miss_reason == "x: requires_grad False -> True"
    fn(bp.tensor(f32(2, 3).astype(np.float64), requires_grad=True), scale=2)
    assert fn.cache_info().last_miss_reason == "scale: static value 1 -> 2"

    @bp.compile
    def first(xs):
        return xs[0] * 2

    first([x])
    first((x, x))
    assert first.cache_info().last_miss_reason == (
        "the structure of the arguments changed (pytree shape or keyword set) at ['xs']: "
        "a list of 1 against a tuple of 2"
    )
    fn(bp.tensor(f32(2, 3).astype(np.float64), requires_grad=True), scale=2.5)
    assert fn.cache_info().last_miss_reason == "scale: static 2 -> traced float"
    fn(bp.tensor(f32(2, 3).astype(np.float64), requires_grad=True), scale=3.5)
    assert fn.cache_info().traces == 6  # a new float value does not retrace


def test_python_control_flow_on_a_traced_value_names_the_users_line():
    @bp.compile
    def branchy(x):
        if bp.sum(x) > 0:
            return x
        return -x

    line = here(offset=-4)
    with pytest.raises(bp.TracingError) as info:
        branchy(bp.tensor(f32(3)))
    assert line in str(info.value) and "bp.where" in str(info.value)
    assert branchy.cache_info().entries == 0  # nothing half-done


def test_shape_errors_name_the_op_shapes_and_the_users_line():
    @bp.compile
    def bad(a, b):
        return a @ b

    line = here(offset=-2)
    with pytest.raises(bp.ShapeError) as info:
        bad(bp.tensor(f32(4, 3)), bp.tensor(f32(5, 2)))
    message = str(info.value)
    assert "matmul" in message and "(4, 3)" in message and "(5, 2)" in message
    assert line in message
    with pytest.raises(bp.ShapeError, match="cannot be broadcast"):
        bp.tensor(f32(3)) + bp.tensor(f32(4))


@pytest.mark.reference
def test_nested_compiled_functions_inline_into_one_region():
    @bp.compile
    def inner(x):
        return bp.tanh(x) * 2

    @bp.compile
    def outer(x):
        return bp.sum(inner(x) + inner(x * 3))

    x = bp.tensor(f32(3), requires_grad=True)
    out = outer(x)
    assert out.grad_fn.name == "outer" and out.grad_fn.next_regions == []
    assert inner.cache_info().traces == 0
    out.backward()
    xv = x.numpy()
    expected = 2 * (1 - np.tanh(xv) ** 2) + 6 * (1 - np.tanh(3 * xv) ** 2)
    np.testing.assert_allclose(x.grad.numpy(), expected, rtol=1e-5)


@pytest.mark.reference
def test_compiled_regions_chain_with_eager_ops_and_other_regions():
    @bp.compile
    def layer(w, x):
        return bp.tanh(x @ w)

    w1 = bp.tensor(f32(3, 3), requires_grad=True)
    x = bp.tensor(f32(2, 3), requires_grad=True)
    h = layer(w1, x * 2)
    loss = bp.sum(layer(w1, h) ** 2)
    loss.backward()
    value, grads = bp.value_and_grad(
        lambda w, x: bp.sum(bp.tanh(bp.tanh((x * 2) @ w) @ w) ** 2), argnums=(0, 1)
    )(w1, x)
    np.testing.assert_allclose(loss.numpy(), value.numpy(), rtol=1e-6)
    np.testing.assert_allclose(w1.grad.numpy(), grads[0].numpy(), rtol=1e-5)
    np.testing.assert_allclose(x.grad.numpy(), grads[1].numpy(), rtol=1e-5)


def test_captured_tensors_are_inputs_and_receive_gradients():
    w = bp.tensor(f32(3), requires_grad=True)

    @bp.compile
    def uses_global(x):
        return bp.sum(x * w)

    x = bp.tensor(f32(3))
    uses_global(x).backward()
    np.testing.assert_allclose(w.grad.numpy(), x.numpy())


def test_value_and_grad_pytrees_has_aux_and_argnums():
    def loss(params, x):
        pred = x @ params["w"] + params["b"]
        return bp.mean(pred**2), pred

    params = {"w": bp.tensor(f32(3, 2)), "b": bp.tensor(f32(2))}
    x = bp.tensor(f32(5, 3))
    (value, pred), grads = bp.value_and_grad(loss, has_aux=True)(params, x)
    p = x.numpy() @ params["w"].numpy() + params["b"].numpy()
    np.testing.assert_allclose(value.numpy(), np.mean(p**2), rtol=1e-5)
    np.testing.assert_allclose(pred.numpy(), p, rtol=1e-5)
    assert set(grads) == {"w", "b"}
    np.testing.assert_allclose(grads["w"].numpy(), x.numpy().T @ (2 * p / p.size), rtol=1e-4)
    np.testing.assert_allclose(grads["b"].numpy(), np.sum(2 * p / p.size, 0), rtol=1e-4)
    gw, gx = bp.grad(lambda w, x: bp.sum(x @ w), argnums=(0, 1))(params["w"], x)
    assert gw.shape == (3, 2) and gx.shape == (5, 3)
    with pytest.raises(bp.TracingError, match="scalar loss"):
        bp.grad(lambda x: x * 2)(x)


def test_grad_of_grad_matches_analytic_second_derivative():
    x = bp.tensor(np.array([0.3, -1.2, 2.0]))
    second = bp.grad(lambda x: bp.sum(bp.grad(lambda y: bp.sum(bp.tanh(y) * y**2))(x)))(x)
    xv = x.numpy()
    t = np.tanh(xv)
    d1 = lambda v: (1 - np.tanh(v) ** 2) * v**2 + 2 * v * np.tanh(v)  # noqa: E731
    numeric = (d1(xv + 1e-6) - d1(xv - 1e-6)) / 2e-6
    np.testing.assert_allclose(second.numpy(), numeric, rtol=1e-6)
    assert t.shape == second.shape


@pytest.mark.filterwarnings("ignore::backplan.Float64PromotionWarning")  # float64 meant here
def test_type_promotion_follows_numpy_2():
    a32 = bp.tensor(np.ones(2, np.float32))
    i64 = bp.tensor(np.array([1, 2]))
    assert (a32 * 2.0).dtype == np.float32
    assert (a32 * 2).dtype == np.float32
    assert (i64 * 2).dtype == np.int64
    assert (i64 * 2.5).dtype == np.float64
    assert (i64 / i64).dtype == np.float64
    assert (a32 + bp.tensor(np.ones(2))).dtype == np.float64
    assert (a32 > 0).dtype == np.bool_
    assert bp.tensor([1.5]).dtype == np.float32
    assert bp.tensor(np.array([1.5])).dtype == np.float64


def test_indexing_slicing_and_gather_with_gradients():
    xv = f32(4, 5, 3)
    x = bp.tensor(xv, requires_grad=True)
    idx = np.array([2, 0, 2])
    rows = np.array([0, 3])
    cols = np.array([1, 4])
    pieces = [x[1], x[:, 1:4:2], x[..., -1], x[None, ::-1, 2], x[:, idx], x[rows, cols]]
    expected = [xv[1], xv[:, 1:4:2], xv[..., -1], xv[None, ::-1, 2], xv[:, idx], xv[rows, cols]]
    for got, want in zip(pieces, expected, strict=True):
        np.testing.assert_array_equal(got.numpy(), want)
    bp.sum(x[:, idx] * 2).backward()
    grad = np.zeros_like(xv)
    np.add.at(grad, (slice(None), idx), 2.0)
    np.testing.assert_array_equal(x.grad.numpy(), grad)
    with pytest.raises(IndexError, match="out of range"):
        x[7]


@pytest.mark.numba
def test_fast_path_uses_the_tensors_of_each_call_and_falls_back_when_unusual():
    @bp.compile
    def weighted(a, b, scale=2.0):
        return bp.sum(a * b) * scale

    vg = bp.value_and_grad(lambda a, b: bp.sum(a * b))
    for _ in range(3):  # later calls take the fast path
        a, b = bp.tensor(f32(3), requires_grad=True), bp.tensor(f32(3))
        np.testing.assert_allclose(
            weighted(a, b).numpy(), 2 * np.sum(a.numpy() * b.numpy()), rtol=1e-6
        )
        value, grad = vg(a, b)
        np.testing.assert_allclose(grad.numpy(), b.numpy(), rtol=1e-6)
    assert weighted.cache_info().traces == 1 and weighted.cache_info().hits == 2
    same = bp.tensor(f32(3))
    np.testing.assert_allclose(
        weighted(same, same).numpy(), 2 * np.sum(same.numpy() ** 2), rtol=1e-6
    )
    other = bp.tensor(f32(3))
    np.testing.assert_allclose(
        weighted(same, other).numpy(), 2 * np.sum(same.numpy() * other.numpy()), rtol=1e-6
    )
    np.testing.assert_allclose(
        weighted(same, other, scale=3.0).numpy(),
        3 * np.sum(same.numpy() * other.numpy()),
        rtol=1e-6,
    )
    np.testing.assert_allclose(
        weighted(same, other, scale=4.0).numpy(),
        4 * np.sum(same.numpy() * other.numpy()),
        rtol=1e-6,
    )
    # requires_grad False; a passed float after the default (a constant); a new float: none
    assert weighted.cache_info().traces == 3


def test_value_and_grad_and_grad_keep_the_same_cache_books_as_compile():
    """One planned-function base: every kind counts traces and hits and names the last miss."""
    for make in (bp.compile, bp.value_and_grad, bp.grad):
        fn = make(lambda x: (x * x).sum())
        x = bp.tensor(np.ones(3), requires_grad=make is bp.compile)
        fn(x)
        fn(x)
        fn(bp.tensor(np.ones(4), requires_grad=make is bp.compile))
        info = fn.cache_info()
        # the second size makes the axis dynamic: the plan for (3,) gives way to the symbolic one
        assert (info.traces, info.misses, info.entries) == (2, 2, 1), make.__name__
        assert info.hits >= 1, make.__name__
        assert "(3,) -> (4,)" in info.last_miss_reason, (make.__name__, info.last_miss_reason)


def test_a_miss_is_explained_against_the_closest_cached_signature():
    @bp.compile
    def fn(p, x):
        return bp.sum(p["a"] * 2) + bp.sum(x)

    one = {"a": bp.tensor(f32(2))}
    two = {"a": bp.tensor(f32(2)), "c": bp.tensor(f32(2))}
    fn(one, bp.tensor(f32(4, 3)))
    fn(two, bp.tensor(f32(4, 3)))  # the last call, but of another structure
    fn(one, bp.tensor(f32(5, 3)))
    reason = "x: shape (4, 3) -> (5, 3); axis 0 of x is dynamic from now on (x.shape[0])"
    assert fn.cache_info().last_miss_reason.startswith(reason)
    vg = bp.value_and_grad(fn)
    vg(one, bp.tensor(f32(4, 3)))
    vg(two, bp.tensor(f32(4, 3)))
    vg(one, bp.tensor(f32(5, 3)))
    assert vg.cache_info().last_miss_reason.startswith(reason)  # not args[1]


def test_a_batch_and_its_labels_of_another_rank_become_dynamic_together():
    """x[n, 3] and labels[n] change size together: one symbol for both (the learned axes'
    ranks differ; this crashed with a ValueError at the second batch size)."""

    @bp.compile
    def fn(x, labels):
        return bp.sum(x) + bp.sum(labels)

    fn(bp.tensor(f32(4, 3)), bp.tensor(f32(4)))
    fn(bp.tensor(f32(6, 3)), bp.tensor(f32(6)))
    reason = fn.cache_info().last_miss_reason
    assert "axis 0 of x, labels is dynamic from now on (x.shape[0])" in reason, reason
    out = fn(bp.tensor(np.ones((5, 3), np.float32)), bp.tensor(np.ones(5, np.float32)))
    assert out.item() == 20.0
    assert fn.cache_info().traces == 2


def test_a_list_holding_traced_tensors_becomes_a_tensor_as_eagerly():
    """x * (x[0], 2.0, 3.0): eagerly NumPy reads the list; traced, its elements are stacked
    (np.asarray cannot read a traced value), as jnp.asarray does."""
    x = bp.tensor(np.array([1.5, -2.0, 4.0], np.float32))

    def scaled(x):
        return x * (x[0], 2.0, 3.0) + bp.sum(bp.tensor([[x[1], 1.0], [0.5, x[2]]]))

    eager = scaled(x)
    compiled = bp.compile(scaled)(x)
    np.testing.assert_allclose(compiled.numpy(), eager.numpy(), rtol=1e-6)
    np.testing.assert_allclose(eager.numpy(), [2.25 + 3.5, -4.0 + 3.5, 12.0 + 3.5], rtol=1e-6)
    assert compiled.dtype == np.float32


@pytest.mark.parametrize("not_a_function", [3, {"w": 1.0}])
def test_compile_of_something_that_is_no_function_is_refused_at_once(not_a_function):
    with pytest.raises(TypeError, match="bp.compile takes a function, got"):
        bp.compile(not_a_function)
    with pytest.raises(TypeError, match="bp.compile takes a function, got"):
        bp.compile(donate_argnums=(0,))(not_a_function)


def _non_scalar_loss(w):
    return w * 2.0


def _loss_without_aux(w):
    return (w * 2.0).sum()


def test_a_differentiated_function_returning_the_wrong_thing_is_named_with_its_line():
    w = bp.tensor(np.ones((2, 3), np.float32))
    line = _non_scalar_loss.__code__.co_firstlineno
    with pytest.raises(bp.TracingError) as info:
        bp.value_and_grad(_non_scalar_loss)(w)
    assert f"_non_scalar_loss (test_compile.py:{line}) returned a tensor f32[2, 3]" in str(
        info.value
    )
    line = _loss_without_aux.__code__.co_firstlineno
    with pytest.raises(bp.TracingError) as info:
        bp.value_and_grad(_loss_without_aux, has_aux=True)(w)
    assert f"_loss_without_aux (test_compile.py:{line}) to return (loss, aux), it returned a" in (
        str(info.value)
    )


def test_argnums_past_the_call_names_the_function_and_the_calling_line():
    """It said only 'argnums=3 but only 2 positional arguments given'."""
    w = bp.tensor(np.ones((2, 3), np.float32))
    defined = _loss_without_aux.__code__.co_firstlineno
    with pytest.raises(TypeError) as info:
        bp.value_and_grad(_loss_without_aux, argnums=2)(w)  # the calling line
    said = str(info.value)
    assert f"argument 2 of _loss_without_aux (test_compile.py:{defined})" in said
    assert f"the call at test_compile.py:{info.tb.tb_lineno} passes 1 positional" in said


def test_an_int_argument_to_differentiate_is_named_as_the_argument_with_the_calling_line():
    """It said 'holds an int64 tensor leaf at <leaf>' and no line."""
    with pytest.raises(TypeError) as info:
        bp.grad(_loss_without_aux)(np.arange(3))  # the calling line
    said = str(info.value)
    assert "argument 0 of a differentiated function is an int64 tensor (the call at " in said
    assert f"test_compile.py:{info.tb.tb_lineno})" in said and "<leaf>" not in said


@pytest.mark.parametrize("api", ["value_and_grad", "grad"])
def test_a_compile_option_given_to_value_and_grad_says_where_it_belongs(api):
    """bp.value_and_grad(loss, dynamic=...) raised Python's own "unexpected keyword argument
    'dynamic'"; the error now shows the call that takes it."""
    with pytest.raises(TypeError, match=rf"bp.{api}\(bp.compile\(loss, dynamic=\.\.\.\)\)"):
        getattr(bp, api)(lambda x: x.sum(), dynamic={"x": {0: "n"}})
    with pytest.raises(TypeError, match="they are bp.compile options"):
        getattr(bp, api)(lambda x: x.sum(), donate_argnums=(0,), remat=False)
    with pytest.raises(TypeError, match="unexpected keyword argument 'nonsense'"):
        getattr(bp, api)(lambda x: x.sum(), nonsense=1)
