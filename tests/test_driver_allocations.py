"""A compiled driver must allocate nothing of its own: every buffer a step holds is one the plan
places and the checked mode (BACKPLAN_CHECK_MEMORY=1) counts. A copy the driver would make (a
strided view read by a GEMM or a row kernel, a GEMM operand broadcast over the batch, a literal
operand, a logsumexp over scattered axes) is a node of the lowered plan instead
(ir/strided_copies.py), and the checked mode refuses a driver that still allocates, naming its
line. Rendering only (no Numba compile) except where a step is run."""

from __future__ import annotations

import numpy as np
import pytest
from test_codegen import batch_graph, sample_batches

import backplan as bp
from backplan.bench.memory_audit import model_step
from backplan.bench.memory_calls import counted_calls, model_arrays, printed_calls
from backplan.bench.models import MODELS
from backplan.bench.peers.backplan_peer import bench_function
from backplan.codegen.render.driver_allocations import uncounted_allocations
from backplan.codegen.render.emit import generate
from backplan.codegen.run.memory_check import MemoryCheckError, checked_memory, refuse_uncounted
from backplan.ir.lowering import lower
from backplan.ir.pipeline import build_joint_plan
from backplan.runtime.backend import use_backend


def _allocating(plans) -> list[str]:
    found = []
    for plan in plans:
        found += [f"@{plan.graph.name} {line}" for line in _driver_lines(plan)]
    return found


def _region(traced) -> list:
    """A compiled function's forward plan and, where it has one, its backward plan."""
    plans = traced.program.plans
    return [p for p in (plans.forward, plans.backward) if p is not None]


def _driver_lines(plan) -> list[str]:
    return uncounted_allocations(generate(lower(plan)).source)


@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_no_op_samples_driver_allocates(dtype):
    plans = []
    for samples in sample_batches(dtype):
        graph, _, wrt = batch_graph(samples, dtype)
        plans.append(build_joint_plan(graph, wrt))
    assert _allocating(plans) == []


@pytest.mark.parametrize("name", [n for n, spec in MODELS.items() if spec.train])
def test_no_bench_model_steps_driver_allocates(name):
    """value_and_grad, compile (forward and backward plans) and the adam training step."""
    params, batch = model_arrays(name)
    loss = bench_function(MODELS[name])
    plans = [bp.value_and_grad(loss).trace(params, *batch).plan]
    plans += _region(bp.compile(loss).trace(params, *batch))
    train_step, arguments, _ = model_step(name, "train")
    plans += _region(train_step.trace(*arguments))
    assert _allocating(plans) == []


X = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
LABELS = np.array([0, 1, 2, 3, 0, 1])

# Ops compiled as calls of their own, reading what the driver used to copy: a strided view
# (transposed, sliced with a step), a literal, a batch broadcast, axes that are not adjacent.
READERS = {
    "softmax of a transpose": lambda x: bp.sum(bp.softmax(x.T, axis=-1) * 2.0),
    "log_softmax of a strided slice": lambda x: bp.sum(bp.log_softmax(x[:, ::2], axis=-1)),
    "cumsum of a transpose": lambda x: bp.sum(bp.cumsum(x.T, axis=1) ** 2),
    "cross_entropy of a transpose": lambda x: bp.cross_entropy(x.T, bp.tensor(LABELS)),
    "matmul by a literal": lambda x: bp.sum(x @ bp.ones((6, 3), dtype="float32")),
    "matmul broadcast over a batch": lambda x: bp.sum(
        (x * bp.tensor(np.ones((3, 1, 1), np.float32)))
        @ (x.reshape(1, 1, 4, 6) * bp.tensor(np.ones((2, 1, 1, 1), np.float32))).transpose(
            0, 1, 3, 2
        )
    ),
    "logsumexp over axes 0 and 2": lambda x: bp.sum(bp.logsumexp(x.reshape(2, 2, 6), axis=(0, 2))),
    "attention on the heads of a fused qkv projection": lambda x: _qkv_attention(x),
}


def _qkv_attention(x):
    """q, k and v sliced out of one projection (a size-1 axis dropped from a strided slice):
    read in place by the attention kernel, as the plan places them (the driver copied each)."""
    qkv = bp.reshape(x, (1, 4, 3, 1, 2))
    q, k, v = (bp.transpose(qkv[:, :, j], (0, 2, 1, 3)) for j in range(3))
    return bp.sum(bp.softmax(q @ bp.swapaxes(k, -1, -2) * 0.5, axis=-1) @ v)


@pytest.mark.parametrize("name", sorted(READERS))
def test_a_copy_the_driver_would_make_is_a_planned_buffer(name):
    fn = READERS[name]
    assert _driver_lines(bp.value_and_grad(fn).trace(bp.tensor(X)).plan) == []


def test_each_copy_counted_equals_printed_on_every_call():
    """The copies are buffers the checked mode counts and explain's peak includes: a step
    reading all of them holds what explain prints, on both backends."""

    def loss(x):
        return sum(fn(x) for fn in READERS.values())

    for backend in ("reference", "numba"):
        with use_backend(backend), checked_memory():
            step = bp.value_and_grad(loss)
            x = bp.tensor(X)
            report = bp.explain(step, x)
            assert counted_calls(lambda: step(x), 3) == printed_calls(report, 3), backend  # noqa: B023
            with use_backend("reference"):
                expected = bp.value_and_grad(loss)(x)
            got = step(x)
            np.testing.assert_allclose(np.asarray(got[0]), np.asarray(expected[0]), rtol=1e-5)
            np.testing.assert_allclose(np.asarray(got[1]), np.asarray(expected[1]), rtol=1e-4)


def test_the_checked_mode_refuses_a_driver_that_allocates_naming_its_line():
    source = (
        "@njit\ndef run(v0, v1):\n"
        "    # %1 = softmax %0 {axis=1} : f32[6,4]\n"
        "    v2 = v0.transpose(1, 0)\n"
        "    softmax_rows(np.ascontiguousarray(v2).reshape((6, 4)), v1, False)\n"
    )
    with pytest.raises(MemoryCheckError) as caught:
        refuse_uncounted("step", source)
    message = str(caught.value)
    assert "line 5: softmax_rows(np.ascontiguousarray(v2)" in message
    assert "(for %1 = softmax %0" in message and "@step" in message
    refuse_uncounted("step", source.replace("np.ascontiguousarray(v2)", "v3"))  # no copy: passes


def test_views_are_not_allocations():
    source = (
        "def run(v0, scratch_f32):\n"
        "    v1_1d = v0.reshape(-1)\n"
        "    v2 = scratch_f32[0:24].reshape((4, 6)).transpose(1, 0)\n"
        "    return (np.broadcast_to(v2.reshape((6, 4, 1)), (6, 4, 3)),)\n"
        "def helper(x):\n"
        "    return np.empty(3)\n"  # not the driver
    )
    assert uncounted_allocations(source) == []
    assert uncounted_allocations(source.replace("v0.reshape(-1)", "np.full((3,), 1.0)")) == [
        "line 2: v1_1d = np.full((3,), 1.0)"
    ]


@pytest.mark.parametrize("dtype", [bp.bfloat16, bp.float16])
def test_a_16_bit_batch_broadcast_matmul_copies_its_bits_into_a_planned_buffer(dtype):
    """The planned copy of a 16-bit operand moves its stored bits (a copy loop once widened
    them and stored the float32 value unrounded: NaN and zeros); counted == printed."""
    rng = np.random.default_rng(1)
    a = bp.tensor(rng.standard_normal((2, 1, 3, 4)).astype(dtype))
    b = bp.tensor(rng.standard_normal((3, 4, 2)).astype(dtype))

    def loss(a):
        return bp.sum((a @ b).astype(np.float32))

    with use_backend("reference"):
        expected = bp.value_and_grad(loss)(a)
    with use_backend("numba"), checked_memory():
        step = bp.value_and_grad(loss)
        assert _driver_lines(step.trace(a).plan) == []
        report = bp.explain(step, a)
        assert counted_calls(lambda: step(a), 3) == printed_calls(report, 3)
        value, grad = step(a)
    np.testing.assert_allclose(np.asarray(value), np.asarray(expected[0]), rtol=1e-2)
    got, want = (np.asarray(g).astype(np.float32) for g in (grad, expected[1]))
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


def test_a_reshape_that_only_moves_size_one_axes_is_read_through_an_index():
    """The driver's form of such a reshape of a strided view: an index NumPy and Numba both
    take as a view, giving what reshape gives."""
    from backplan.codegen.render.opaque import size_one_index

    base = np.arange(2 * 5 * 3 * 4, dtype=np.float32).reshape(2, 5, 3, 4)[:, :, 1:2]
    for after in [(2, 5, 4), (2, 1, 5, 4), (2, 5, 4, 1), (1, 2, 5, 1, 4)]:
        index = size_one_index(base.shape, after)
        view = eval(f"base[{index}]")  # noqa: S307 - the index made above
        assert view.shape == after and np.shares_memory(view, base)
        np.testing.assert_array_equal(view, base.reshape(after))
    assert size_one_index((4, 8), (8, 4)) is None  # sizes moved: a copy
    assert size_one_index((4, 8), (4, 8)) is None  # nothing to do
