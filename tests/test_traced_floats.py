"""Python floats are traced as weakly typed 0-d inputs; static_argnums / static_argnames keep
values static; the signature cache is an LRU with a retrace warning; in-place operators raise."""

import operator
import warnings

import numpy as np
import pytest

import backplan as bp


def f32(*shape):
    return np.random.default_rng(0).standard_normal(shape).astype(np.float32)


def test_twenty_learning_rates_one_trace_and_float32_stays_float32():
    @bp.compile
    def scaled(w, lr):
        return w - lr * w * 0.5

    w = bp.tensor(f32(3))
    for lr in np.linspace(0.01, 1.0, 20):
        out = scaled(w, float(lr))
        np.testing.assert_allclose(out.numpy(), w.numpy() - float(lr) * w.numpy() * 0.5, rtol=1e-6)
        assert out.dtype == np.float32
    info = scaled.cache_info()
    assert (info.traces, info.hits) == (1, 19)


def test_traced_floats_promote_like_python_floats():
    @bp.compile
    def mixed(i, d, lr):
        return i * lr, d * lr, lr * 2.0, bp.sqrt(lr) + lr

    ints, doubles = bp.tensor(np.arange(3)), bp.tensor(np.ones(3))
    as_int, as_double, alone, unary = mixed(ints, doubles, 0.25)
    assert as_int.dtype == np.float64 and as_double.dtype == np.float64
    assert alone.dtype == np.float64 and alone.item() == 0.5
    assert unary.item() == 0.75
    np.testing.assert_array_equal(as_int.numpy(), [0.0, 0.25, 0.5])


def test_a_traced_float_where_a_python_number_is_needed_says_to_make_it_static():
    @bp.compile
    def needs_number(x, eps):
        return x + 1.0 if float(eps) > 0 else x

    with pytest.raises(bp.TracingError, match=r"static_argnames=\('eps',\)"):
        needs_number(bp.tensor(f32(2)), 0.1)

    @bp.compile(static_argnames=("eps",))
    def static_eps(x, eps):
        return x + 1.0 if eps > 0 else x

    np.testing.assert_allclose(static_eps(bp.tensor(f32(2)), 0.1).numpy(), f32(2) + 1.0)
    static_eps(bp.tensor(f32(2)), 0.2)
    assert static_eps.cache_info().last_miss_reason == "eps: static value 0.1 -> 0.2"

    @bp.compile(static_argnums=1)
    def by_position(x, scale):
        return x * scale

    by_position(bp.tensor(f32(2)), 2.0)
    by_position(bp.tensor(f32(2)), scale=3.0)  # by keyword: still static
    assert by_position.cache_info().traces == 2


def test_a_float_default_the_caller_does_not_pass_is_a_constant_as_in_jax():
    @bp.compile
    def normed(x, *, eps=1e-5):
        return bp.layer_norm(x, eps=eps)  # eps must be a Python number here

    x = f32(4, 6)
    want = (x - x.mean(1, keepdims=True)) / np.sqrt(x.var(1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(normed(bp.tensor(x)).numpy(), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(bp.TracingError, match="static_argnames"):
        normed(bp.tensor(x), eps=1e-3)  # passed: traced, so refused where a number is needed

    @bp.compile
    def scaled(x, scale=2.0):
        return x * scale

    np.testing.assert_allclose(scaled(bp.tensor(x)).numpy(), 2 * x)
    for scale in (3.0, 4.0):  # passed floats are traced: one trace for both
        np.testing.assert_allclose(scaled(bp.tensor(x), scale).numpy(), scale * x, rtol=1e-6)
    assert scaled.cache_info().traces == 2


def test_bad_static_options_are_refused():
    with pytest.raises(ValueError, match="not a parameter"):
        bp.compile(lambda x: x, static_argnames=("y",))
    with pytest.raises(ValueError, match="static_argnums=5"):
        bp.compile(lambda x: x, static_argnums=5)
    with pytest.raises(ValueError, match="cache_size must be at least 1"):
        bp.compile(lambda x: x, cache_size=0)


def test_value_and_grad_traces_floats_too():
    vg = bp.value_and_grad(lambda w, scale: (w * scale).sum())
    w = bp.tensor(f32(3))
    for scale in (1.0, 2.0, 3.0):
        value, grad = vg(w, scale)
        np.testing.assert_allclose(grad.numpy(), [scale] * 3)
    assert vg.cache_info().traces == 1


def test_a_differentiated_float_stays_weakly_typed():
    """Differentiating with respect to a float must not widen a float32 computation: the loss
    has the dtype it has when the float is not differentiated (as in JAX)."""
    x = bp.tensor(np.arange(3, dtype=np.float32))

    @bp.compile
    def loss(x, scale=1.0):
        return (x * scale * scale).sum()

    for argnums in (0, (0, 1), 1):
        value, grads = bp.value_and_grad(loss, argnums=argnums)(x, 2.0)
        assert value.dtype == np.float32 and value.item() == 12.0
    d_scale = grads.item()
    assert d_scale == 2 * 2.0 * 3.0  # d/ds sum(x s^2) = 2 s sum(x)
    vg = bp.value_and_grad(loss, argnums=1)
    assert [vg(x, s)[1].item() for s in (1.0, 3.0)] == [6.0, 18.0]
    assert vg.cache_info().traces == 1


def test_retrace_warning_after_eight_retraces_names_what_changed():
    @bp.compile(dynamic=False)  # else axis 0 turns dynamic at the second size
    def by_shape(x):
        return x * 2.0

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in range(1, 12):
            by_shape(bp.tensor(np.ones(n, np.float32)))
    retrace = [w for w in caught if issubclass(w.category, bp.RetraceWarning)]
    assert len(retrace) == 1  # once
    message = str(retrace[0].message)
    assert "traced 9 times" in message and "x: shape (8,) -> (9,)" in message
    assert retrace[0].filename == __file__


def test_cache_is_least_recently_used_and_capped():
    @bp.compile(cache_size=2, dynamic=False)
    def double(x):
        return x * 2

    a, b, c = (bp.tensor(np.ones(n, np.float32)) for n in (1, 2, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", bp.RetraceWarning)
        double(a), double(b), double(a)  # a is the most recent
        double(c)  # evicts b
        assert double.cache_info().entries == 2
        double(a)
        assert double.cache_info().traces == 3  # a still cached
        double(b)
        assert double.cache_info().traces == 4  # b was evicted
        np.testing.assert_array_equal(double(b).numpy(), [2.0, 2.0])
    assert bp.compile(lambda x: x).cache_size == 64


@pytest.mark.parametrize(
    "symbol, in_place",
    [
        ("-=", operator.isub),
        ("+=", operator.iadd),
        ("*=", operator.imul),
        ("/=", operator.itruediv),
        ("@=", operator.imatmul),
        ("**=", operator.ipow),
    ],
)
def test_in_place_operators_raise_with_the_optimizer_idiom(symbol, in_place):
    w = bp.tensor(np.eye(2, dtype=np.float32), requires_grad=True)
    with pytest.raises(TypeError, match=r"(?s)immutable.*bp\.optim\.sgd.*opt\.update") as info:
        in_place(w, bp.tensor(np.eye(2, dtype=np.float32)))
    assert f"tensor {symbol}" in str(info.value)


def test_the_pytorch_parameter_update_habit_raises():
    params = {"w": bp.tensor(np.eye(2, dtype=np.float32), requires_grad=True)}
    with pytest.raises(TypeError, match="in-place -="):
        params["w"] -= 0.1 * params["w"]
    assert params["w"].is_leaf  # unchanged
    for p in params.values():
        with pytest.raises(TypeError, match="in-place -="):
            p -= 0.1


def test_a_traced_float_as_an_op_attribute_says_to_make_it_static():
    @bp.compile
    def fill(x, value):
        return x + bp.full((3,), value)  # full broadcasts a traced value

    np.testing.assert_array_equal(fill(bp.tensor(np.ones(3, np.float32)), 0.5).numpy(), [1.5] * 3)
    fill(bp.tensor(np.ones(3, np.float32)), 2.5)
    assert fill.cache_info().traces == 1

    @bp.compile
    def normed(x, eps):
        return bp.layer_norm(x, eps=eps)

    with pytest.raises(
        bp.TracingError,
        match=r"traced float \(argument eps\) at test_traced_floats.*static_argnames=\('eps',\)",
    ):
        normed(bp.tensor(f32(2, 3)), 1e-5)

    @bp.compile
    def encoded(labels, depth):
        return bp.one_hot(labels, depth)

    with pytest.raises(
        bp.TracingError,
        match=r"a Python number, got the traced float argument depth.*argnames=\('depth',\)",
    ):
        encoded(bp.tensor(np.array([1])), 2.0)


def test_a_numpy_scalar_to_differentiate_is_named_with_what_to_pass():
    """np.float64(3.0) was called 'a float64 leaf', which reads like a float tensor."""
    vg = bp.value_and_grad(lambda x: x * 2.0)
    with pytest.raises(TypeError, match=r"a NumPy scalar \(numpy\.float64\).*float\(x\)"):
        vg(np.float64(3.0))
    assert vg(float(np.float64(3.0)))[1] == 2.0


def test_a_list_of_traced_floats_makes_the_float32_tensor_it_makes_eagerly():
    """Python floats passed to a compiled function are traced as weak 0-d float64 inputs;
    stacked as they were, bp.tensor([a, b]) and bp.sum([a, b]) gave float64 compiled where
    the same call gives float32 eagerly."""

    def made(values, w):
        return bp.tensor(values), bp.sum(values), bp.as_tensor([values[0], 1.0]) * w

    w = bp.tensor(f32(2))
    eager = made([0.25, 0.5], w)
    compiled = bp.compile(made)([0.25, 0.5], w)
    for e, c in zip(eager, compiled, strict=True):
        assert c.dtype == e.dtype == np.float32
        np.testing.assert_array_equal(c.numpy(), e.numpy())
    doubles = bp.compile(lambda v, d: bp.tensor([v[0], d]))([0.5], bp.tensor(np.float64(2.0)))
    assert doubles.dtype == np.float64  # a float64 element still promotes
