"""A 2-D float32 / float64 GEMM reads an operand that is strided where it lives (a sliced,
reversed or broadcast view, of an argument or of a value inside the plan) in place: backplan's
GEMM takes any strides (codegen/kernels/matmul.py own_gemm_strided_at), so no copy of the
operand goes into the arena (ir/strided_copies.py reads_strided_operand). Before, each such
operand was copied into the scratch arena first (+7.6 MB for w1[:, ::2] in
bench/argument_layouts.py). Results against the reference interpreter, odd, negative and zero
strides and empty dims included; the checked mode equal to explain on every call; the peak
the same as with the operand passed in C order."""

from __future__ import annotations

import numpy as np
import pytest

import backplan as bp
from backplan.bench.memory_calls import counted_calls, printed_calls
from backplan.codegen.run.memory_check import checked_memory
from backplan.runtime.backend import use_backend

CALLS = 3


def view_copies_in(plan) -> int:
    """The plan's copies (an astype to the same dtype) of views of buffers: not of a literal
    (the gradient of a sum, ones, which a GEMM reads from a buffer made for it)."""
    found = 0
    for node in plan.graph.nodes:
        if node.op == "astype" and node.dtype == node.inputs[0].dtype:
            source = node.inputs[0]
            while source.op in ("slice", "transpose", "broadcast_to", "reshape"):
                source = source.inputs[0]
            found += source.op != "full"
    return found


def _loss(w, x):
    return bp.sum(bp.tanh(x @ w) ** 2)


def _loss_wt(w, x):
    return bp.sum(bp.tanh(x @ w.T) ** 2)  # the transpose taken as the GEMM's flag


def _wide(rows, cols, dtype=np.float32, seed=0):
    return np.random.default_rng(seed).standard_normal((rows, cols)).astype(dtype)


def _weights():
    """name -> (w as passed, a loss): views of wider, taller or reversed arrays, 1,000 deep:
    past the GEMM's k block (256), where reading in place packs fewer bytes than a copy takes
    (a weight of a few KiB is copied: ir/strided_copies.py _copies_cheaper)."""
    w = _wide(DEEP, 40)
    return {
        "every other column": (w[:, ::2], _loss),
        "a column block": (w[:, 7:27], _loss),
        "reversed rows": (w[::-1, :20], _loss),
        "reversed columns, step 2": (w[:, ::-2], _loss),
        "every other row, as w.T": (_wide(40, DEEP)[::2], _loss_wt),
        "column block, as w.T": (_wide(20, DEEP + 24)[:, 3 : DEEP + 3], _loss_wt),
        "float64, every other column": (_wide(DEEP, 41, np.float64)[:, ::2], _loss),
    }


DEEP = 1000


def _x(w, rows=9, dtype=None):
    k = w.shape[0] if w.ndim == 2 else w.shape[-1]
    return _wide(rows, k, dtype or w.dtype, seed=1)


def _run(f, w, x):
    value, grad = f(w, x)
    return value.numpy(), grad.numpy()


def _checked(loss, w, x):
    """(value, gradient) on numba in the checked mode, every call's count against explain's,
    and explain's allocated peak of the first call, its GEMM packing pages apart."""
    with use_backend("numba"), checked_memory():
        f = bp.value_and_grad(loss)
        report = bp.explain(f, w, x)
        counted = counted_calls(lambda: f(w, x), CALLS)
        assert counted == printed_calls(report, CALLS)
        peak = report.peak_on_call(1)
        # less backplan's GEMM packing pages: a strided operand runs on it, where a C-order
        # one may run on BLAS (codegen/kernels/gemm/packing.py)
        packing = peak.peak_step.held.get("packing", 0)
        return _run(f, w, x), peak.allocated_peak_bytes - packing


def _close(got, want, dtype):
    rtol = 1e-4 if dtype == np.float32 else 1e-10
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * 10)


@pytest.mark.parametrize("name", list(_weights()))
def test_a_strided_weight_is_read_in_place_by_the_gemm(name):
    w, loss = _weights()[name]
    x = _x(w if loss is _loss else w.T)
    got, peak = _checked(loss, w, x)
    with use_backend("reference"):
        want = _run(bp.value_and_grad(loss), w, x)
    _close(got, want, w.dtype)
    # the same step with the weight in C order holds what this one holds: no operand copy
    # (the packing apart: the strided step's products run on backplan's GEMM)
    _, c_order_peak = _checked(loss, np.ascontiguousarray(w), x)
    assert peak == c_order_peak


def _inner(x, w1, w2):
    """Products reading views of values inside the plan: every other column, reversed rows
    (a negative row stride), one row broadcast over the batch (a zero row stride); 600 deep
    and 300 rows (the weight gradients' depth), past the GEMM's k block, so that reading them
    in place packs fewer bytes than copies take."""
    h = bp.tanh(x @ w1)  # (300, 1200)
    a = h[:, ::2] @ w2  # (300, 600) @ (600, 8)
    b = h[::-1, :600] @ w2
    c = bp.broadcast_to(h[2:3, 600:], (300, 600)) @ w2
    return bp.sum(a * b + c)


def test_views_inside_the_plan_are_read_in_place_and_give_the_interpreters_results():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((300, 12)).astype(np.float32)
    w1 = rng.standard_normal((12, 1200)).astype(np.float32)
    w2 = (rng.standard_normal((600, 8)) / np.sqrt(600)).astype(np.float32)
    with use_backend("numba"), checked_memory():
        f = bp.value_and_grad(_inner, argnums=(1, 2))
        report = bp.explain(f, x, w1, w2)
        assert counted_calls(lambda: f(x, w1, w2), CALLS) == printed_calls(report, CALLS)
        value, grads = f(x, w1, w2)
        compiled = f.trace(x, w1, w2).runner().compiled
    assert view_copies_in(compiled.plan) == 0  # none of the views is copied for its GEMM
    assert "own_gemm_strided_at" in compiled.source and "ascontiguousarray" not in compiled.source
    with use_backend("reference"):
        want_value, want_grads = bp.value_and_grad(_inner, argnums=(1, 2))(x, w1, w2)
    np.testing.assert_allclose(value.numpy(), want_value.numpy(), rtol=1e-4)
    for got, want in zip(grads, want_grads, strict=True):  # sums of 300-600 terms
        scale = np.abs(want.numpy()).max()
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("rows", [0, 1])
def test_empty_and_one_row_products_with_a_strided_weight(rows):
    w = _wide(24, 40)[:, ::2]
    x = _x(w, rows=rows)
    got, _ = _checked(_loss, w, x)
    with use_backend("reference"):
        want = _run(bp.value_and_grad(_loss), w, x)
    _close(got, want, w.dtype)


def test_an_empty_inner_dimension_gives_zeros():
    w = _wide(0, 40)[:, ::2]  # (0, 20): every product sums nothing
    x = np.ones((5, 0), np.float32)
    with use_backend("numba"):
        f = bp.compile(lambda w, x: x @ w)
        for _ in range(2):
            np.testing.assert_array_equal(f(w, x).numpy(), np.zeros((5, 20), np.float32))


def _placed(view: np.ndarray, base: np.ndarray):
    """(flat base, element offset, element strides) of a view of base, as a driver passes it."""
    item = base.itemsize
    offset = (view.__array_interface__["data"][0] - base.__array_interface__["data"][0]) // item
    return base.reshape(-1), np.intp(offset), tuple(np.intp(s // item) for s in view.strides)


CASES = {  # (a's base shape, its view, ta, b's base shape, its view, tb): op(a) @ op(b) fits
    "reversed": ((19, 23), lambda a: a[::-1, ::2], False, (12, 29), lambda b: b[:, ::-1], False),
    "every third row": ((19, 23), lambda a: a[::3], False, (69, 9), lambda b: b[::3], False),
    "transposed flags": (
        (19, 23),
        lambda a: a[:, 1::3],
        True,
        (29, 38),
        lambda b: b[::2, ::-2],
        True,
    ),
    "no rows": ((19, 23), lambda a: a[:0], False, (23, 9), lambda b: b, False),
}


@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", list(CASES))
def test_the_strided_entry_against_numpy(parts, dtype, case):
    from backplan.codegen.kernels.gemm import vector_width
    from backplan.codegen.kernels.matmul import own_gemm_strided_at, own_gemm_strided_at_par

    a_shape, a_view, ta, b_shape, b_view, tb = CASES[case]
    rng = np.random.default_rng(3)
    a_base = rng.standard_normal(a_shape).astype(dtype)
    b_base = rng.standard_normal(b_shape).astype(dtype)
    a, b = a_view(a_base), b_view(b_base)
    op_a, op_b = (a.T if ta else a), (b.T if tb else b)
    (m, k), n = op_a.shape, op_b.shape[1]
    out = np.full(m * n + 3, np.nan, dtype)
    entry = [np.bool_(ta), np.bool_(tb), np.intp(m), np.intp(n), np.intp(k)]
    entry += [*_placed(a, a_base), *_placed(b, b_base), out, np.intp(3)]
    if parts == 1:
        own_gemm_strided_at(vector_width(), *entry)
    else:
        own_gemm_strided_at_par(np.intp(parts), vector_width(), *entry)
    want = op_a.astype(np.float64) @ op_b.astype(np.float64)
    rtol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(out[3:].reshape(m, n), want, rtol=rtol, atol=rtol)
    assert np.isnan(out[:3]).all()  # nothing written before its offset


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_zero_row_stride_reads_one_row_for_every_row(dtype):
    """A broadcast operand (one row for every row of op(a): stride 0) read in place."""
    from backplan.codegen.kernels.gemm import vector_width
    from backplan.codegen.kernels.matmul import own_gemm_strided_at

    rng = np.random.default_rng(4)
    row = rng.standard_normal(40).astype(dtype)
    a = np.broadcast_to(row[::2], (7, 20))  # strides (0, 2 items)
    b_base = rng.standard_normal((20, 9)).astype(dtype)
    out = np.empty(7 * 9, dtype)
    base, offset, strides = row, np.intp(0), (np.intp(0), np.intp(2))
    own_gemm_strided_at(
        vector_width(), np.bool_(False), np.bool_(False), np.intp(7), np.intp(9), np.intp(20),
        base, offset, strides, *_placed(b_base, b_base), out, np.intp(0),
    )  # fmt: skip
    rtol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(out.reshape(7, 9), a @ b_base, rtol=rtol, atol=rtol)
