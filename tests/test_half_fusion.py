"""What fused 16-bit plans store between loops: the 16-bit value, not its float32 widening."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import backplan as bp
from backplan.ir.builder import Builder
from backplan.ir.fusion import group_kernels, materialized
from backplan.ir.graph import Graph
from backplan.ir.types import TensorType
from backplan.ir.widen import widen, widen_with_origin
from backplan.runtime.backend import use_backend


def _row_scaled(build, x):
    h = build.tanh(x)
    return build.mul(h, build.sum(h, axes=(1,), keepdims=True))


def test_a_loop_reading_a_widened_16_bit_value_of_another_loop_reads_the_16_bits():
    """tanh(x) * sum(tanh(x)) in bfloat16: the product waits for the row sums, so it is a
    second loop reading tanh(x); it recomputes the widening cast and reads the bfloat16 value
    (2 bytes an element) instead of a stored float32 copy (4 bytes)."""
    graph = Graph()
    build = Builder(graph)
    x = graph.add_input(TensorType("bf16", (8, 4)))
    graph.outputs = [_row_scaled(build, x)]
    wide = widen(graph)
    kernels = group_kernels(wide)
    loops = [k for k in kernels if k.kind == "loop" and k.shape == (8, 4)]
    assert len(loops) == 2, [(k.kind, k.shape) for k in kernels]
    stored = [v for v in materialized(wide, kernels) if v.shape == (8, 4)]
    assert [v.dtype for v in stored] == ["bf16", "bf16"], [(v.op, v.dtype) for v in stored]


def test_the_16_bit_read_keeps_values_within_rounding_of_float64():
    """Both executors within a few bfloat16 roundings of the float64 value (they round at
    different places: docs/ops.md), relative to the terms summed."""
    rng = np.random.default_rng(5)
    x = bp.tensor(rng.standard_normal((8, 4)).astype(np.float32)).astype(bp.bfloat16)
    h = np.tanh(x.astype(bp.float32).numpy().astype(np.float64))
    want = h * h.sum(axis=1, keepdims=True)
    bound = (
        4 * float(ml_dtypes.finfo(ml_dtypes.bfloat16).eps) * np.abs(h) * np.abs(h).sum(1)[:, None]
    )

    def fn(x):
        h = bp.tanh(x)
        return h * bp.sum(h, axis=1, keepdims=True)

    for backend in ("numba", "reference"):
        with use_backend(backend):
            got = bp.compile(fn)(x).astype(bp.float32).numpy()
        assert np.all(np.abs(got - want) <= bound), backend


def test_a_read_back_cast_joins_the_latest_loop_not_a_loop_of_its_own():
    """A read-back of a 16-bit copy (ir/fusion.py _read_backs) may not join the loop that made
    the copy; it joins the latest loop of its shape instead, as any other node (it opened a
    loop of its own, and bfloat16 ln_gelu's layer-norm gradient read its inputs again)."""
    graph = Graph()
    build = Builder(graph)
    x = graph.add_input(TensorType("f32", (8, 4)))
    v = build.tanh(x)
    copy = build.astype(v, dtype="bf16")
    after_sum = build.mul(x, build.sum(v, axes=(1,), keepdims=True))
    read_back = build.astype(copy, dtype="f32")
    graph.outputs = [build.mul(read_back, after_sum), build.mul(v, v)]
    kernels = group_kernels(graph)
    loops = [k for k in kernels if k.kind == "loop"]
    assert len(loops) == 2, [[n.op for n in k.nodes] for k in loops]
    assert copy in loops[0].nodes and read_back in loops[1].nodes


def _row_made_later(graph, build):
    """A bfloat16 row computed by a loop of its own after the graph's earlier loops (a 16-bit
    input's widening would not do: loops recompute it, ir/fusion.py _spread_widenings)."""
    return build.astype(build.exp(graph.add_input(TensorType("f32", (4,)))), dtype="bf16")


def _rounded_then_read_again(graph, build):
    """n = x * rowsum(x) in float32 and its bfloat16 rounding c, as bfloat16 layer_norm makes
    them; c * g (g a bfloat16 row a loop of its own shape computes after c's) and n read again
    after."""
    x = graph.add_input(TensorType("bf16", (8, 4)))
    wide = build.astype(x, dtype="f32")
    n = build.mul(wide, build.sum(wide, axes=(1,), keepdims=True))
    c = build.astype(n, dtype="bf16")
    y = build.mul(c, _row_made_later(graph, build))
    return c, build.mul(build.astype(y, dtype="f32"), n)


def test_a_loop_recomputing_a_value_rounds_it_instead_of_reading_its_16_bit_rounding():
    """The rounding is the op's own (not a saved_dtype read-back): the loop that recomputes n
    rounds it too, so no loop stores c between them (bfloat16 ln_gelu stored layer_norm's
    rounded output in a pass of its own and read it back beside x)."""
    graph = Graph()
    build = Builder(graph)
    c, out = _rounded_then_read_again(graph, build)
    graph.outputs = [out]
    wide, origin = widen_with_origin(graph)
    kernels = group_kernels(wide, origin)
    stored = [v for v in materialized(wide, kernels) if v.shape == (8, 4)]
    assert stored == [wide.outputs[0]], [(v.op, v.dtype) for v in stored]
    rounded_again = [v for k in kernels for v in k.recomputed if origin.get(v) is c]
    assert [v.dtype for v in rounded_again] == ["bf16"]


def test_a_saved_dtype_read_back_is_still_read_not_recomputed():
    """The same graph with c's widening written in the graph (as saved_dtype's read-back is):
    the copy stays stored and read, as saved_dtype asks."""
    graph = Graph()
    build = Builder(graph)
    c, _ = _rounded_then_read_again(graph, build)
    n = c.inputs[0]
    graph.outputs = [build.mul(build.astype(c, dtype="f32"), build.mul(n, n))]
    wide, origin = widen_with_origin(graph)
    kernels = group_kernels(wide, origin)
    stored = [v for v in materialized(wide, kernels) if v.shape == (8, 4)]
    assert [origin.get(v) for v in stored if v.dtype == "bf16"] == [c], stored


def test_a_loop_reading_only_a_rounding_recomputes_the_value_and_rounds_it_itself():
    """c = bfloat16(n), n = (x - m) * m with m a row sum (as layer_norm's normalised rows):
    the loop that reads only c (its column sum makes it a loop of its own) recomputes n from
    x and the stored row sums and rounds it itself, so the row loop stores no c (bfloat16
    ln_gelu's statistics pass wrote its 4096x1024 normalised rows, 8 MB, for the next loop to
    read back beside x)."""
    graph = Graph()
    build = Builder(graph)
    x = graph.add_input(TensorType("bf16", (8, 4)))
    wide = build.astype(x, dtype="f32")
    m = build.sum(wide, axes=(1,), keepdims=True)
    c = build.astype(build.mul(build.sub(wide, m), m), dtype="bf16")
    y = build.mul(c, _row_made_later(graph, build))
    graph.outputs = [build.sum(y, axes=(0,)), build.mul(y, x)]
    wide, origin = widen_with_origin(graph)
    kernels = group_kernels(wide, origin)
    stored = [v for v in materialized(wide, kernels) if v.shape == (8, 4)]
    assert all(origin.get(v) is not c for v in stored), [(v.op, v.dtype) for v in stored]
    rounded_again = [v for k in kernels for v in k.recomputed if origin.get(v) is c]
    assert [v.dtype for v in rounded_again] == ["bf16"]


@pytest.mark.parametrize("driver", ["inline", "python"])
@pytest.mark.parametrize("dtype", [bp.bfloat16, np.float16], ids=["bf16", "f16"])
def test_a_row_kernel_value_another_loop_widens_again_is_stored_whole(monkeypatch, driver, dtype):
    """The gradient of tanh(layer_norm(x)) in 16 bits: the row kernel of the forward and the
    first backward terms stores a 16-bit term that the next loop reads again, widening it
    where it reads (ir/fusion.py spreads the widening). The row kernel had kept that term one
    row at a time (codegen/render/emit.py _row_local), so the next loop read one row's worth
    and garbage: gradients of 1e37 against 0.5. Checked against float64 on the reference
    interpreter, at a shape where every row differs."""
    monkeypatch.setenv("BACKPLAN_DRIVER", driver)
    rng = np.random.default_rng(11)
    x = rng.standard_normal((6, 40))

    def loss(x):
        return bp.sum(bp.tanh(bp.layer_norm(x)) * 0.75)

    with use_backend("numba"):
        value, grad = bp.value_and_grad(loss)(bp.tensor(x.astype(dtype)))
    with use_backend("reference"):
        exact = bp.value_and_grad(loss)(bp.tensor(x.astype(dtype).astype(np.float64)))[1].numpy()
    got = grad.numpy().astype(np.float64)
    assert grad.dtype == dtype
    scale = np.abs(exact).max()
    assert np.abs(got - exact).max() <= 2e-2 * scale, np.abs(got - exact).max() / scale
