"""backplan_gemm_f32_f64 / f64_f32: a float32 operand beside a float64 one, widened while
packing (float64 result and sums), the GEMM a float64 step's weight gradients call on the
float32 copies saved_dtype=bp.float32 keeps (ir/wide_reads.py), instead of float64 copies."""

from __future__ import annotations

import numpy as np
import pytest
from test_gemm_mixed import FLAGS, SHAPES

import backplan as bp
from backplan.codegen.kernels import gemm as own


@pytest.mark.parametrize("width", (512, 256))
@pytest.mark.parametrize(("ta", "tb"), FLAGS)
@pytest.mark.parametrize("f32_first", (True, False))
def test_a_float32_operand_beside_float64_gives_the_float64_product_bit_for_bit(
    width, ta, tb, f32_first
):
    rng = np.random.default_rng(17)
    for m, n, k in SHAPES:
        shape_a, shape_b = (k, m) if ta else (m, k), (n, k) if tb else (k, n)
        a, b = (rng.standard_normal(s) for s in (shape_a, shape_b))
        if f32_first:
            a = a.astype(np.float32)
        else:
            b = b.astype(np.float32)
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        c = np.full((m, n), np.nan)
        own.gemm(width, ta, tb, 1.0, a, b, 0.0, c)
        c_wide = np.full((m, n), np.nan)  # the same GEMM on float64 copies: the same sums
        own.gemm(width, ta, tb, 1.0, a64, b64, 0.0, c_wide)
        np.testing.assert_array_equal(c, c_wide, (m, n, k))
        expected = (a64.T if ta else a64) @ (b64.T if tb else b64)
        np.testing.assert_allclose(c, expected, rtol=1e-12, atol=1e-12 * max(k, 1))


def test_a_float64_matmul_reads_the_float32_value_under_its_float64_copy_and_views():
    """matmul(transpose(astype(x_f32, f64)), w): the GEMM reads x's float32 transpose, and
    the float64 copy, read by nothing else, is not made; a copy another op reads stays."""
    from backplan.ir.builder import Builder
    from backplan.ir.graph import Graph
    from backplan.ir.types import TensorType
    from backplan.ir.wide_reads import reads_wide_copies, wide_copies_read_as_is

    g = Graph()
    b = Builder(g)
    x = g.add_input(TensorType("f32", (8, 4)))
    w = g.add_input(TensorType("f64", (8, 3)))
    wide = b.astype(x, dtype="f64")
    g.outputs = [b.matmul(b.swap_last2(wide), w)]
    assert reads_wide_copies(g)
    new, origin = wide_copies_read_as_is(g)
    assert [(n.op, n.dtype) for n in new.nodes] == [("transpose", "f32"), ("matmul", "f64")]
    assert [i.dtype for i in new.nodes[-1].inputs] == ["f32", "f64"]
    assert origin[new.nodes[-1]] is g.outputs[0]
    g.outputs.append(b.exp(wide))
    ops = [(n.op, n.dtype) for n in wide_copies_read_as_is(g)[0].nodes]
    assert ("astype", "f64") in ops and ("matmul", "f64") in ops


def _four_layers(p, x):
    h = x
    for w in p[:3]:
        h = bp.tanh(h @ w)
    return bp.mean((h @ p[3]) ** 2)


class _Step:
    """value_and_grad or bp.compile + backward() of _four_layers: its gradients, the peak
    calls it predicts, its report."""

    def __init__(self, path, saved, arrays, x):
        self.path, self.arrays, self.x = path, arrays, x
        if path == "compile":
            self.fn = bp.compile(_four_layers, saved_dtype=saved)
            self.params = [bp.tensor(w, requires_grad=True) for w in arrays]
        else:
            self.fn = bp.value_and_grad(_four_layers, saved_dtype=saved)

    def run(self):
        if self.path != "compile":
            return [g.numpy() for g in self.fn(self.arrays, self.x)[1]]
        for p in self.params:
            p.grad = None
        self.fn(self.params, self.x).backward()
        return [p.grad.numpy() for p in self.params]

    def calls(self):
        from backplan.ir.peak import joint_calls, region_calls

        if self.path == "compile":
            return region_calls(self.fn.trace(self.params, self.x).program.plans)
        entry = self.fn.lookup((self.arrays, self.x), {}, count_hit=False)[1]
        return joint_calls(entry.plan, 1)

    def report(self):
        first = self.params if self.path == "compile" else self.arrays
        return self.fn.explain(first, self.x)


@pytest.mark.parametrize("path", ["compile", "value_and_grad"])
def test_float32_saved_copies_of_a_float64_step_are_read_by_the_mixed_gemm(path):
    """saved_dtype=bp.float32 on a float64 4-layer MLP: the weight gradients' GEMMs read the
    float32 copies as they are. Under bp.compile the step peaked 1.17x above full precision
    with float64 copies of them (so saved_dtype kept full precision since 4383c89); now below.
    Counted peak equal to the predicted one; values against the reference interpreter."""
    from backplan.codegen.run.memory_check import checked_memory, measure
    from backplan.ir.peak import predicted_peak
    from backplan.runtime.backend import use_backend

    rng = np.random.default_rng(1)
    shapes = [(16, 64), (64, 64), (64, 64), (64, 4)]
    arrays = [rng.standard_normal(s) * 0.2 for s in shapes]
    x = bp.tensor(rng.standard_normal((128, 16)))
    peaks, grads = {}, {}
    for saved in (None, bp.float32):
        step = _Step(path, saved, arrays, x)
        with use_backend("numba"), checked_memory():
            step.run()
            with measure() as measured:
                grads[saved] = step.run()
            assert measured.peak == predicted_peak(step.calls(), "numba").allocated_peak_bytes
            explained = step.report()
        peaks[saved] = explained.peak_bytes
        if saved is not None:
            text = " ".join(str(explained).split())
            assert "(f32 x f64, mixed)" in text or "(f64 x f32, mixed)" in text
            assert "stay in full precision" not in explained.saved_dtype_note
            with use_backend("reference"):
                want = step.run()
            for got, ref in zip(grads[saved], want, strict=True):
                np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-15)
    assert peaks[bp.float32] < peaks[None]
    for got, full in zip(grads[bp.float32], grads[None], strict=True):
        np.testing.assert_allclose(got, full, rtol=1e-5, atol=1e-9)
        assert not np.array_equal(got, full)  # it did read rounded copies
