"""bp.random and dropout: threefry matches Random123's known answers, compiled draws are
bit-identical to the reference interpreter, keys are traced (no retrace per key), split keys
give independent streams, dropout masks are recomputed in backward bit for bit, and host
randomness while tracing is refused."""

import math
import random
import re

import numpy as np
import pytest

import backplan as bp
from backplan.codegen.kernels.random import threefry2x32 as compiled_threefry
from backplan.codegen.run.compiled import CompiledPlan
from backplan.ir.builder import Builder
from backplan.ir.graph import Graph
from backplan.ir.interpreter import run_plan
from backplan.ir.lowering import lower
from backplan.ir.ops.random import threefry2x32
from backplan.ir.pipeline import build_region_plans
from backplan.ir.types import TensorType

# Random123 kat_vectors, threefry2x32 with 20 rounds: (counter, key, result)
KNOWN_ANSWERS = [
    ((0, 0), (0, 0), (0x6B200159, 0x99BA4EFE)),
    ((0xFFFFFFFF,) * 2, (0xFFFFFFFF,) * 2, (0x1CB996FC, 0xBB002BE7)),
    ((0x243F6A88, 0x85A308D3), (0x13198A2E, 0x03707344), (0xC4923A9C, 0x483DF7A0)),
]


@pytest.mark.parametrize("counter,key,expected", KNOWN_ANSWERS)
def test_threefry_matches_random123_known_answers(counter, key, expected):
    words = [np.uint64(v) for v in (*key, *counter)]
    assert tuple(int(v) for v in threefry2x32(*words)) == expected
    assert tuple(compiled_threefry(*key, *counter)) == expected


def draws_graph():
    """Every random op and bernoulli-style comparison on one key, in one plan."""
    graph = Graph(name="draws")
    b = Builder(graph)
    key = graph.add_input(TensorType("i64", (2,)))
    outputs = [
        b.random_uniform(key, shape=(5, 7), dtype="f32"),
        b.random_uniform(key, shape=(9,), dtype="f64"),
        b.random_normal(key, shape=(3, 3), dtype="f32"),
        b.random_normal(key, shape=(4,), dtype="f64"),
        b.random_split(key, count=5),
    ]
    outputs.append(b.lt(outputs[0], b.scalar(0.3, "f32")))
    big = b.random_uniform(key, shape=(300, 301), dtype="f32")  # the parallel kernel
    outputs.append(b.sum(big, axes=(0, 1)))
    outputs.append(big)
    graph.outputs = outputs
    return graph


def test_compiled_draws_are_bit_identical_to_the_reference_interpreter():
    plan = build_region_plans(draws_graph(), [False]).forward
    compiled = CompiledPlan(lower(plan))
    assert "random_uniform_par(" in compiled.source and "random_split(" in compiled.source
    key = np.array([123456789, 4000000000], np.int64)
    expected = run_plan(plan, [key.copy()])
    got = compiled([key.copy()])
    for name, g, e in zip(
        ["u32", "u64", "n32", "n64", "split", "mask", "sum", "big"], got, expected, strict=True
    ):
        assert g.dtype == e.dtype and g.shape == e.shape, name
        if name.startswith("n"):  # Box-Muller's log/cos may differ in the last bit of float64
            np.testing.assert_allclose(g, e, rtol=1e-6 if g.dtype == np.float32 else 1e-13)
        elif name == "sum":
            np.testing.assert_allclose(g, e, rtol=1e-5)
        else:
            np.testing.assert_array_equal(g, e, err_msg=name)


def test_a_bad_key_is_refused_by_both_backends():
    plan = build_region_plans(draws_graph(), [False]).forward
    bad = np.array([-1, 3], np.int64)
    with pytest.raises(bp.ExecutionError, match="key"):
        run_plan(plan, [bad.copy()])
    with pytest.raises(bp.ExecutionError, match="key"):
        CompiledPlan(lower(plan))([bad.copy()])
    with pytest.raises(bp.DtypeError, match=r"bp.random.key"):
        bp.random.normal(bp.tensor([1.0, 2.0]).astype("int64").reshape(1, 2), (3,))


def test_keys_are_traced_so_a_new_key_does_not_retrace():
    @bp.compile
    def noise(key, x):
        return x + bp.random.normal(key, x.shape)

    x = bp.tensor(np.zeros(6, np.float32))
    keys = bp.random.split(bp.random.key(7), 3)
    results = [noise(k, x).numpy() for k in keys]
    assert noise.cache_info().traces == 1
    assert not np.array_equal(results[0], results[1])
    np.testing.assert_array_equal(noise(keys[0], x).numpy(), results[0])  # reproducible
    np.testing.assert_array_equal(bp.random.normal(keys[0], (6,)).numpy(), results[0])  # eager


def test_key_from_seed_and_split_follow_the_documented_words():
    np.testing.assert_array_equal(bp.random.key(5).numpy(), [0, 5])
    np.testing.assert_array_equal(bp.random.key(2**40 + 3).numpy(), [2**8, 3])
    k1, k2 = bp.random.split(bp.random.key(0))
    assert k1.shape == (2,) and k1.dtype == np.int64
    assert not np.array_equal(k1.numpy(), k2.numpy())
    np.testing.assert_array_equal(bp.random.split(bp.random.key(0))[0].numpy(), k1.numpy())
    with pytest.raises(TypeError, match="seed"):
        bp.random.key(1.5)
    with pytest.raises(ValueError, match="num"):
        bp.random.split(k1, 0)


def test_split_keys_give_independent_uniform_and_normal_streams():
    n = 40_000
    k1, k2 = bp.random.split(bp.random.key(2024))
    a = bp.random.uniform(k1, (n,), "float64").numpy()
    b = bp.random.uniform(k2, (n,), "float64").numpy()
    tolerance = 5 / math.sqrt(n)  # five standard errors
    assert abs(np.corrcoef(a, b)[0, 1]) < tolerance
    assert abs(np.corrcoef(a[:-1], a[1:])[0, 1]) < tolerance  # neighbours too
    for u in (a, b):
        assert 0 <= u.min() and u.max() < 1
        counts = np.histogram(u, bins=10, range=(0, 1))[0]
        chi2 = np.sum((counts - n / 10) ** 2 / (n / 10))
        assert chi2 < 33.7  # 9 degrees of freedom, p = 1e-4
    z = bp.random.normal(k1, (n,)).numpy()
    assert abs(z.mean()) < tolerance and abs(z.std() - 1) < tolerance
    assert abs(np.mean(z**3)) < 3 * tolerance and abs(np.mean(z**4) - 3) < 10 * tolerance
    low, high = -2.0, 3.0
    u = bp.random.uniform(k2, (1000,), low=low, high=high).numpy()
    assert low <= u.min() and u.max() < high and u.dtype == np.float32


def test_bernoulli_frequency_and_shape():
    mask = bp.random.bernoulli(bp.random.key(3), 0.3, (20_000,)).numpy()
    assert mask.dtype == np.bool_
    assert abs(mask.mean() - 0.3) < 0.02
    p = bp.tensor(np.array([0.0, 1.0], np.float32))
    np.testing.assert_array_equal(bp.random.bernoulli(bp.random.key(3), p).numpy(), [False, True])
    with pytest.raises(ValueError, match="p must"):
        bp.random.bernoulli(bp.random.key(3), 1.5, (2,))


def test_dropout_scales_survivors_and_is_identity_at_rate_zero():
    x = bp.tensor(np.linspace(1, 2, 10_000).astype(np.float32))
    key = bp.random.key(11)
    assert bp.dropout(x, 0.0, key) is x
    y = bp.dropout(x, 0.25, key).numpy()
    kept = y != 0
    assert abs(kept.mean() - 0.75) < 0.02
    np.testing.assert_allclose(y[kept], x.numpy()[kept] / 0.75, rtol=1e-6)
    for rate in (1.0, -0.1, 2):
        with pytest.raises(ValueError, match=r"rate must be a number in \[0, 1\)"):
            bp.dropout(x, rate, key)


def dropout_loss(x, key):
    return bp.dropout(bp.tanh(x), 0.5, key)


def test_dropout_mask_is_recomputed_in_backward_bit_identical_to_forward():
    rng = np.random.default_rng(0)
    x_data = rng.uniform(0.5, 1.5, (64, 33)).astype(np.float32)
    g = rng.standard_normal((64, 33)).astype(np.float32)
    key = bp.random.key(99)
    grads = {}
    for remat in (True, False):
        x = bp.tensor(x_data, requires_grad=True)
        fn = bp.compile(remat=remat)(dropout_loss)
        y = fn(x, key)
        program = fn.trace(x, key).program
        intermediate = sum(i.nbytes for i in program.saved_info if not i.is_region_input)
        recomputed = [n.op for r in program.plans.recomputed for n in r.chain]
        if remat:
            assert "random_uniform" in recomputed
            assert intermediate == 64 * 33 * 4  # tanh's output only; the mask is not saved
        else:
            assert intermediate == 64 * 33 * (4 + 1)  # tanh's output and the bool mask
        y.backward(g)
        mask = y.numpy() != 0  # tanh(x) > 0 here, so zeros are exactly the dropped elements
        expected = np.where(mask, g * np.float32(2.0), 0) * (1 - np.tanh(x_data) ** 2)
        np.testing.assert_allclose(x.grad.numpy(), expected, rtol=1e-5)
        np.testing.assert_array_equal(x.grad.numpy() != 0, mask)  # the same mask, bit for bit
        grads[remat] = x.grad.numpy()
    np.testing.assert_array_equal(grads[True], grads[False])


def test_dropout_under_value_and_grad_uses_one_mask_for_value_and_gradient():
    x = bp.tensor(np.ones((8, 8), np.float32), requires_grad=True)

    def loss(x, key):
        return bp.sum(bp.dropout(x, 0.5, key) * 3.0)

    value, grad = bp.value_and_grad(loss)(x, bp.random.key(4))
    kept = grad.numpy() != 0
    assert value.item() == pytest.approx(kept.sum() * 2.0 * 3.0)
    np.testing.assert_array_equal(grad.numpy()[kept], 6.0)


@pytest.mark.parametrize(
    "draw",
    [
        lambda: np.random.randn(3),
        lambda: np.random.default_rng(0).normal(size=3),
        lambda: np.full(3, random.random()),
        lambda: np.full(3, random.gauss(0, 1)),
    ],
    ids=["np.random.randn", "np.random.default_rng", "random.random", "random.gauss"],
)
def test_host_randomness_while_tracing_raises_and_points_to_bp_random(draw):
    originals = (np.random.randn, np.random.default_rng, random.random)

    @bp.compile
    def noisy(x):
        return x + bp.tensor(draw().astype(np.float32))

    with pytest.raises(bp.TracingError, match=r"while tracing.*bp\.random\.key"):
        noisy(bp.tensor(np.zeros(3, np.float32)))
    assert (np.random.randn, np.random.default_rng, random.random) == originals  # restored
    assert draw().shape == (3,)  # and working outside traces


def test_bernoulli_draws_the_same_numbers_whichever_way_p_arrives():
    """p as a Python constant, as a traced float argument and eagerly: one key, one draw."""
    key = bp.random.key(7)
    eager = bp.random.bernoulli(key, 0.3, (64,)).numpy()

    @bp.compile
    def traced(key, p):
        return bp.random.bernoulli(key, p, (64,))

    constant = bp.compile(lambda key: bp.random.bernoulli(key, 0.3, (64,)))
    np.testing.assert_array_equal(traced(key, 0.3).numpy(), eager)
    np.testing.assert_array_equal(constant(key).numpy(), eager)
    assert 0 < eager.sum() < 64


@pytest.mark.parametrize("dtype", [bp.bfloat16, bp.float16])
def test_a_16_bit_dropout_zeroes_the_rate_asked_with_the_float32_mask(dtype):
    """A bfloat16 draw has 2**8 values in [0.5, 1): rate 0.1 kept 0.8964 (the mean 0.5% low)
    and rate 0.001 kept every element. The mask is now the float32 one, whatever x's dtype."""
    key = bp.random.key(5)
    ones32 = bp.ones((1000, 1000))
    for rate in (0.1, 0.001):
        want = bp.dropout(ones32, rate, key).numpy() != 0
        got = bp.dropout(bp.ones((1000, 1000), dtype=dtype), rate, key).numpy() != 0
        np.testing.assert_array_equal(got, want)
        assert abs(got.mean() - (1 - rate)) < 4 * np.sqrt(rate * (1 - rate) / got.size)
    as_tensor = bp.dropout(bp.ones((1000, 1000), dtype=dtype), bp.tensor(np.float32(0.1)), key)
    assert as_tensor.dtype == dtype
    np.testing.assert_array_equal(as_tensor.numpy() != 0, bp.dropout(ones32, 0.1, key).numpy() != 0)


def test_bad_random_arguments_name_the_users_line():
    """As every op's errors do: the rate, the seed, the key and the count refused name the line
    that passed them (they named none)."""
    x = bp.tensor(np.ones((4, 5), np.float32))
    calls = [
        lambda: bp.dropout(x, 1.5, bp.random.key(0)),
        lambda: bp.random.key(1.5),
        lambda: bp.dropout(x, 0.5, bp.tensor(np.ones(3))),
        lambda: bp.random.split(bp.random.key(0), 0),
        lambda: bp.random.bernoulli(bp.random.key(0), 2.0, (2,)),
    ]
    for call in calls:
        with pytest.raises((ValueError, TypeError)) as raised:
            call()
        assert "test_random.py:" in str(raised.value), raised.value


def test_a_bad_key_names_the_function_given_it():
    """The key's refusal names the call that was passed it, not only 'expected a key': dropout
    and bernoulli check theirs before drawing through uniform, so uniform is not blamed."""
    x, bad = bp.tensor(np.ones((4, 5), np.float32)), bp.tensor(np.ones(3))
    calls = {
        "bp.dropout": lambda: bp.dropout(x, 0.5, bad),
        "bp.random.bernoulli": lambda: bp.random.bernoulli(bad, 0.5, (2,)),
        "bp.random.uniform": lambda: bp.random.uniform(bad, (2,)),
        "bp.random.normal": lambda: bp.random.normal(bad, (2,)),
        "bp.random.split": lambda: bp.random.split(bad),
    }
    for name, call in calls.items():
        with pytest.raises(bp.DtypeError, match=rf"^{re.escape(name)}: expected a key"):
            call()
