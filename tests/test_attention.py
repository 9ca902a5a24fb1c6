"""Fused attention: hand-written softmax(q @ k^T * c) @ v becomes one op whose backward
recomputes the probabilities, so no (T, S) matrix is saved; scaled_dot_product_attention is the
same op under PyTorch's name. Compiled kernels against the reference interpreter and NumPy on
odd shapes (row blocks of 128, one key, empty axes, strided views, nan); PyTorch parity where
installed; bad inputs raise naming the op, the shapes and the user's line."""

import os
import subprocess
import sys

import numba
import numpy as np
import pytest
from helpers import here
from op_samples import np_attention, np_attention_grad

import backplan as bp
from backplan.runtime.backend import use_backend

TOL = {np.float32: dict(rtol=2e-5, atol=2e-5), np.float64: dict(rtol=1e-11, atol=1e-11)}


def hand_written(q, k, v, scale):
    return bp.softmax((q @ k.swapaxes(-1, -2)) * scale, axis=-1) @ v


def loss_and_grads(attend, q, k, v, g, backend):
    """attention(q, k, v), and d/dq, d/dk, d/dv of sum(attention * g), from one compiled
    value_and_grad on the given backend."""

    def loss(q, k, v, g):
        out = attend(q, k, v)
        return bp.sum(out * g), out

    with use_backend(backend):
        (_, out), grads = bp.value_and_grad(bp.compile(loss), argnums=(0, 1, 2), has_aux=True)(
            *(bp.tensor(x) for x in (q, k, v, g))
        )
    return out.numpy(), [d.numpy() for d in grads]


def attention_inputs(rng, lead, t, s, d, dv, dtype):
    q, k, v = (
        rng.standard_normal(lead + shape).astype(dtype) for shape in ((t, d), (s, d), (s, dv))
    )
    return q, k, v, rng.standard_normal(lead + (t, dv)).astype(dtype)


def numpy_expected(q, k, v, g, scale, causal):
    out = np_attention(*(x.astype(np.float64) for x in (q, k, v)), scale, causal)
    flat = np_attention_grad(*(x.astype(np.float64) for x in (q, k, v, g)), scale, causal)
    sizes = np.cumsum([q.size, k.size])
    grads = [
        part.reshape(x.shape) for part, x in zip(np.split(flat, sizes), (q, k, v), strict=True)
    ]
    return out, grads


def test_hand_written_attention_fuses_and_saves_no_score_matrix():
    rng = np.random.default_rng(0)
    q, k, v, g = attention_inputs(rng, (2, 3), 7, 9, 5, 4, np.float64)

    def loss(q, k, v):
        return bp.sum(hand_written(q, k, v, 0.4) * bp.tensor(g))

    report = bp.explain(bp.compile(loss), *(bp.tensor(x, requires_grad=True) for x in (q, k, v)))
    assert " = attention " in report.forward_ir and " = softmax " not in report.forward_ir
    assert " = attention_grad " in report.backward_ir
    assert not [s for s in report.saved_buffers if s.shape[-2:] == (7, 9)]  # no scores kept
    # q, k and v for attention_grad, and g for the product with the output
    assert {s.shape for s in report.saved_buffers} == {q.shape, k.shape, v.shape, g.shape}

    expected_out, expected_grads = numpy_expected(q, k, v, g, 0.4, False)
    for backend in ("reference", "numba"):
        out, grads = loss_and_grads(lambda q, k, v: hand_written(q, k, v, 0.4), q, k, v, g, backend)
        np.testing.assert_allclose(out, expected_out, **TOL[np.float64])
        for got, want in zip(grads, expected_grads, strict=True):
            np.testing.assert_allclose(got, want, **TOL[np.float64])


def test_attention_whose_weights_are_returned_keeps_the_unfused_form():
    rng = np.random.default_rng(1)
    q, k, v, _ = attention_inputs(rng, (2,), 4, 6, 3, 3, np.float64)

    @bp.compile
    def with_weights(q, k, v):
        weights = bp.softmax((q @ k.swapaxes(-1, -2)) / 2.0, axis=-1)
        return weights @ v, weights

    args = [bp.tensor(x, requires_grad=True) for x in (q, k, v)]
    assert " = attention " not in bp.explain(with_weights, *args).forward_ir
    out, weights = with_weights(*args)
    np.testing.assert_allclose(out.numpy(), np_attention(q, k, v, 0.5, False), rtol=1e-12)
    np.testing.assert_allclose(weights.numpy().sum(axis=-1), 1.0, rtol=1e-12)


def test_divided_and_left_scaled_scores_fuse_with_the_right_scale():
    rng = np.random.default_rng(2)
    q, k, v, g = attention_inputs(rng, (), 5, 5, 4, 2, np.float64)
    forms = {
        "divide": lambda q, k, v: bp.softmax((q @ k.swapaxes(-1, -2)) / 4.0, axis=-1) @ v,
        "left": lambda q, k, v: bp.softmax(0.25 * (q @ k.swapaxes(-1, -2)), axis=-1) @ v,
        "unscaled": lambda q, k, v: bp.softmax(q @ k.swapaxes(-1, -2), axis=-1) @ v,
    }
    for name, form in forms.items():
        scale = 1.0 if name == "unscaled" else 0.25
        report = bp.explain(bp.compile(form), *(bp.tensor(x) for x in (q, k, v)))
        assert "attention %" in report.forward_ir and f"scale={scale}" in report.forward_ir, name
        out, _ = loss_and_grads(form, q, k, v, g, "numba")
        np.testing.assert_allclose(out, np_attention(q, k, v, scale, False), rtol=1e-11)


CASES = {
    # name: (leading axes, T, S, D, Dv, causal, dtype); one dtype each keeps the cold suite short
    "two-row-blocks": ((1, 2), 130, 33, 7, 5, False, np.float32),
    "two-row-blocks-causal": ((2,), 129, 131, 3, 4, True, np.float64),
    "one-key": ((3,), 7, 1, 1, 2, False, np.float64),
    "causal-more-queries": ((), 9, 4, 3, 3, True, np.float32),
    "three-lead-axes": ((2, 1, 2), 5, 6, 4, 3, True, np.float32),
    # causal blocks stop at the keys their last row sees: 128, 256, then all 300
    "three-row-blocks-causal": ((1,), 300, 300, 3, 2, True, np.float32),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_compiled_attention_equals_reference_and_numpy_on_odd_shapes(case):
    lead, t, s, d, dv, causal, dtype = CASES[case]
    rng = np.random.default_rng(3)
    q, k, v, g = attention_inputs(rng, lead, t, s, d, dv, dtype)

    def attend(q, k, v):
        return bp.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.6)

    expected_out, expected_grads = numpy_expected(q, k, v, g, 0.6, causal)
    ref_out, ref_grads = loss_and_grads(attend, q, k, v, g, "reference")
    out, grads = loss_and_grads(attend, q, k, v, g, "numba")
    tol = TOL[dtype]
    np.testing.assert_allclose(out, ref_out, **tol)
    np.testing.assert_allclose(out, expected_out, **tol)
    for got, ref, want in zip(grads, ref_grads, expected_grads, strict=True):
        np.testing.assert_allclose(got, ref, **tol)
        np.testing.assert_allclose(got, want, rtol=tol["rtol"] * 10, atol=tol["atol"] * 10)


@pytest.mark.parametrize("t,s", [(0, 4), (4, 0), (0, 0)], ids=["no-queries", "no-keys", "none"])
def test_empty_query_or_key_axes_give_empty_or_zero_results(t, s):
    rng = np.random.default_rng(4)
    q, k, v, g = attention_inputs(rng, (2,), t, s, 3, 2, np.float32)
    for backend in ("reference", "numba"):
        out, (dq, dk, dv) = loss_and_grads(bp.scaled_dot_product_attention, q, k, v, g, backend)
        assert out.shape == (2, t, 2) and dq.shape == q.shape and dk.shape == k.shape
        # no keys: each query attends to nothing, so its output (and every gradient) is zero
        for x in (out, dq, dk, dv):
            np.testing.assert_array_equal(x, np.zeros_like(x))


def test_strided_views_of_one_projection_read_in_place_equal_reference():
    """q, k and v as the transformer makes them: transposed head views of one (B, T, 3 * d)
    projection, none of them contiguous."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 6, 24)).astype(np.float32)
    g = rng.standard_normal((2, 2, 6, 4)).astype(np.float32)

    def attend_projection(x, g):
        heads = x.reshape(2, 6, 3, 2, 4).transpose(2, 0, 3, 1, 4)  # (3, B=2, H=2, T=6, dh=4)
        return bp.sum(hand_written(heads[0], heads[1], heads[2], 0.5) * g)

    results = {}
    for backend in ("reference", "numba"):
        with use_backend(backend):
            loss, dx = bp.value_and_grad(bp.compile(attend_projection))(bp.tensor(x), bp.tensor(g))
        results[backend] = (loss.numpy(), dx.numpy())
    np.testing.assert_allclose(results["numba"][0], results["reference"][0], rtol=2e-5)
    np.testing.assert_allclose(results["numba"][1], results["reference"][1], rtol=2e-5, atol=2e-6)
    heads = x.reshape(2, 6, 3, 2, 4).transpose(2, 0, 3, 1, 4).astype(np.float64)
    expected = np.sum(np_attention(heads[0], heads[1], heads[2], 0.5, False) * g)
    np.testing.assert_allclose(results["numba"][0], expected, rtol=2e-5)


def test_nan_in_one_query_spoils_its_row_only_compiled_as_reference():
    rng = np.random.default_rng(6)
    q, k, v, g = attention_inputs(rng, (1,), 4, 5, 3, 2, np.float64)
    q[0, 2, 1] = np.nan
    outs = {}
    for backend in ("reference", "numba"):
        outs[backend], _ = loss_and_grads(bp.scaled_dot_product_attention, q, k, v, g, backend)
    for out in outs.values():
        assert np.isnan(out[0, 2]).all() and np.isfinite(np.delete(out[0], 2, axis=0)).all()
    np.testing.assert_allclose(outs["numba"], outs["reference"], rtol=1e-11)


def test_scaled_dot_product_attention_matches_torch_forward_and_backward():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    for causal in (False, True):
        q, k, v, g = attention_inputs(rng, (2, 3), 6, 8, 4, 5, np.float32)
        tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
        expected = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
        (expected * torch.tensor(g)).sum().backward()

        def attend(q, k, v, causal=causal):
            return bp.scaled_dot_product_attention(q, k, v, is_causal=causal)

        eager = [bp.tensor(x, requires_grad=True) for x in (q, k, v)]
        eager_out = attend(*eager)
        bp.sum(eager_out * bp.tensor(g)).backward()
        out, grads = loss_and_grads(attend, q, k, v, g, "numba")
        tol = dict(rtol=1e-4, atol=1e-5)
        for ours in (eager_out.numpy(), out):
            np.testing.assert_allclose(ours, expected.detach().numpy(), **tol)
        for ours_eager, ours, theirs in zip(eager, grads, (tq, tk, tv), strict=True):
            np.testing.assert_allclose(ours_eager.grad.numpy(), theirs.grad.numpy(), **tol)
            np.testing.assert_allclose(ours, theirs.grad.numpy(), **tol)


def test_bad_attention_inputs_name_the_op_the_shapes_and_the_line():
    f32 = np.zeros((2, 4, 3), np.float32)
    q = bp.tensor(f32)
    with pytest.raises(bp.ShapeError, match=r"leading .* axes") as info:
        line = here(1)
        bp.scaled_dot_product_attention(q, bp.tensor(np.zeros((3, 4, 3), np.float32)), q)
    assert "scaled_dot_product_attention" in str(info.value) and line in str(info.value)
    assert "k (3, 4, 3)" in str(info.value)
    with pytest.raises(bp.DtypeError, match="float32, float64") as info:
        line = here(1)
        bp.scaled_dot_product_attention(q, bp.tensor(f32.astype(np.float64)), q)
    assert line in str(info.value)
    with pytest.raises(bp.ShapeError, match="attn_mask"):
        bp.scaled_dot_product_attention(q, q, q, attn_mask=q)
    with pytest.raises(bp.ShapeError, match="dropout_p"):
        bp.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
    with pytest.raises(TypeError, match="is_causal"):
        bp.scaled_dot_product_attention(q, q, q, is_causal=1)


@pytest.mark.parametrize("choice", ["own", "blas"])
def test_fused_attention_equals_numpy_with_either_gemm(choice, monkeypatch):
    """BACKPLAN_GEMM picks the kernels' GEMM as it does a matmul's: backplan's own, or BLAS
    reading the per-head views in place (rows contiguous, any row stride)."""
    monkeypatch.setenv("BACKPLAN_GEMM", choice)
    monkeypatch.setattr(numba, "get_num_threads", lambda: 1)  # the serial kernels
    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, 9, 3, 2, 5))  # (B, T, q/k/v, H, dh): strided head views
    g = rng.standard_normal((2, 2, 9, 5))

    def attend(x, g):
        q, k, v = (x[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
        return bp.sum(bp.scaled_dot_product_attention(q, k, v, is_causal=True) * g)

    with use_backend("numba"):
        loss, dx = bp.value_and_grad(bp.compile(attend))(bp.tensor(x), bp.tensor(g))
    with use_backend("reference"):
        ref_loss, ref_dx = bp.value_and_grad(bp.compile(attend))(bp.tensor(x), bp.tensor(g))
    q, k, v = (x[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
    expected = np.sum(np_attention(q, k, v, 1 / np.sqrt(5), True) * g)
    np.testing.assert_allclose(loss.numpy(), expected, rtol=1e-11)
    np.testing.assert_allclose(dx.numpy(), ref_dx.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(ref_loss.numpy(), expected, rtol=1e-11)


def test_fusion_switch_keeps_the_written_form_and_refuses_unknown_values(monkeypatch):
    rng = np.random.default_rng(9)
    q, k, v, _ = attention_inputs(rng, (2,), 5, 6, 3, 2, np.float64)
    args = [bp.tensor(x, requires_grad=True) for x in (q, k, v)]

    def attend(q, k, v):
        return hand_written(q, k, v, 0.5)

    monkeypatch.setenv("BACKPLAN_FUSE_ATTENTION", "0")
    report = bp.explain(bp.compile(attend), *args)
    assert " = attention " not in report.forward_ir and " = softmax " in report.forward_ir
    np.testing.assert_allclose(
        bp.compile(attend)(*args).numpy(), np_attention(q, k, v, 0.5, False), rtol=1e-12
    )
    monkeypatch.setenv("BACKPLAN_FUSE_ATTENTION", "off")
    with pytest.raises(bp.BackplanError, match="BACKPLAN_FUSE_ATTENTION='off'"):
        bp.compile(attend)(*args)


def test_attention_bench_runs_every_peer_checked_and_fused_keeps_fewer_bytes():
    done = subprocess.run(
        [sys.executable, "-m", "backplan.bench.attention", "--shape", "1,2,16,2"]
        + ["--rounds", "1", "--seconds", "0.01"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "BACKPLAN_QUIET": "1"},
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr  # every peer's gradients checked
    rows = {
        line[:18].strip(): line[18:].split()
        for line in done.stdout.splitlines()
        if line.startswith("backplan")
    }
    fused, unfused = rows["backplan fused"], rows["backplan unfused"]
    assert float(fused[1]) == 1.0  # the ratio column is against fused
    rates = [line.split() for line in done.stdout.splitlines() if "of the GEMM rate" in line]
    assert [r[0] for r in rates] == ["forward", "backward"]
    assert all(float(r[2]) > 0 and float(r[7].rstrip(":")) > 0 for r in rates)  # kernel, GEMMs
    assert float(fused[2]) < float(unfused[2])  # saved KiB: no (T, S) probabilities kept


# ---- the "bthd" layout: multi-head attention with no head transposition copies ----------------


def multi_head(x, w, wo, heads, causal, hand):
    """The bench transformer's attention: q, k, v are (B, T, H, D) reshapes of one projection
    moved to (B, H, T, D); the output moves back and flattens for the output projection."""
    batch, length, width = x.shape
    proj = x @ w
    qkv = [
        proj[:, :, i * width : (i + 1) * width].reshape(batch, length, heads, width // heads)
        for i in range(3)
    ]
    q, k, v = (t.transpose(0, 2, 1, 3) for t in qkv)
    if hand:
        scores = (q @ k.swapaxes(-1, -2)) * 0.5
        if causal:
            scores = scores + np.triu(np.full((length, length), -np.inf, scores.dtype), 1)
        out = bp.softmax(scores, axis=-1) @ v
    else:
        out = bp.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.5)
    merged = out.transpose(0, 2, 1, 3).reshape(batch, length, width)
    return bp.sum(bp.tanh(merged @ wo))


def multi_head_grads(x, w, wo, heads, causal, hand=False, backend="numba"):
    def loss(x, w, wo):
        return multi_head(x, w, wo, heads, causal, hand)

    args = [bp.tensor(a) for a in (x, w, wo)]
    with use_backend(backend):
        fn = bp.value_and_grad(bp.compile(loss), argnums=(0, 1, 2))
        value, grads = fn(*args)
        report = bp.explain(fn, *args)
    return value.numpy(), [g.numpy() for g in grads], report


def multi_head_inputs(seed, batch, length, width, dtype):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, length, width)).astype(dtype)
    w = (rng.standard_normal((width, 3 * width)) / np.sqrt(width)).astype(dtype)
    wo = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(dtype)
    return x, w, wo


def joint_ir(report) -> str:
    return "\n".join(line for line in str(report).splitlines() if " = " in line and "%" in line)


@pytest.mark.parametrize("length", [1, 7, 33])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_head_transposes_are_gone_and_results_equal_the_unfused_reference(
    length, causal, monkeypatch
):
    """The attention reads the projection's (B, T, H, D) reshapes and writes (B, T, H, D) for
    the output projection: no transpose(0, 2, 1, 3) is left in forward or backward; values and
    gradients equal the unfused form run on the reference interpreter. The driver runs as
    Python, as a first call does by default: the six plans then share their loops (compiled in
    one module, sizes as arguments), where a compiled driver compiles each plan's loops again
    inside its one function; the compiled driver of a bthd plan is
    test_bench_transformer_plan_copies_no_heads_and_keeps_its_gradients's."""
    monkeypatch.setenv("BACKPLAN_DRIVER", "python")
    x, w, wo = multi_head_inputs(10 + length, 2, length, 12, np.float64)
    value, grads, report = multi_head_grads(x, w, wo, 3, causal)
    ir = joint_ir(report)
    assert "layout='bthd'" in ir and " = attention_grad " in ir
    assert "perm=(0, 2, 1, 3)" not in ir
    monkeypatch.setenv("BACKPLAN_FUSE_ATTENTION", "0")
    want, want_grads, unfused = multi_head_grads(x, w, wo, 3, causal, True, "reference")
    assert " = attention " not in joint_ir(unfused)
    np.testing.assert_allclose(value, want, rtol=1e-11)
    for got, expected in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-11)


def test_head_layout_gradients_match_finite_differences_in_float32_compiled():
    x, w, wo = multi_head_inputs(20, 2, 9, 8, np.float64)
    _, grads, _ = multi_head_grads(*(a.astype(np.float32) for a in (x, w, wo)), 2, True, True)
    rng = np.random.default_rng(21)
    for position, arg in enumerate((x, w, wo)):
        direction = rng.standard_normal(arg.shape)
        h, args_plus, args_minus = 1e-6, [x, w, wo], [x, w, wo]
        args_plus = [a + h * direction if i == position else a for i, a in enumerate(args_plus)]
        args_minus = [a - h * direction if i == position else a for i, a in enumerate(args_minus)]
        with use_backend("reference"):
            plus, minus = (
                multi_head(*(bp.tensor(a) for a in args), 2, True, True).numpy()
                for args in (args_plus, args_minus)
            )
        numeric = (plus - minus) / (2 * h)
        np.testing.assert_allclose(np.sum(grads[position] * direction), numeric, rtol=2e-4)


def test_head_layout_is_kept_where_the_output_has_another_reader():
    """An output read as (B, H, T, D) too keeps the "bhtd" layout (and its results)."""
    x, w, wo = multi_head_inputs(30, 1, 5, 8, np.float64)

    def loss(x, w, wo):
        proj = x @ w
        q, k, v = (proj[:, :, i * 8 : (i + 1) * 8].reshape(1, 5, 2, 4).transpose(0, 2, 1, 3)
                   for i in range(3))  # fmt: skip
        out = bp.scaled_dot_product_attention(q, k, v)
        return bp.sum(out.transpose(0, 2, 1, 3).reshape(1, 5, 8) @ wo) + bp.sum(out * out)

    args = [bp.tensor(a) for a in (x, w, wo)]
    ir = joint_ir(bp.explain(bp.value_and_grad(bp.compile(loss)), *args))
    assert "layout='bhtd'" in ir and "layout='bthd'" not in ir
    results = {}
    for backend in ("reference", "numba"):
        with use_backend(backend):
            results[backend] = bp.value_and_grad(bp.compile(loss))(*args)[1].numpy()
    np.testing.assert_allclose(results["numba"], results["reference"], rtol=1e-10)


def test_bench_transformer_plan_copies_no_heads_and_keeps_its_gradients(monkeypatch):
    """The bench transformer block (small sizes): its compiled step copies no head tensor (the
    attention output and dq, dk, dv were each copied between (B, H, T, D) and (B, T, H * D)),
    and its loss and gradients equal the unfused attention on the reference interpreter."""
    from backplan.bench.models import BACKPLAN_KINDS, MODELS

    spec = MODELS["transformer"]
    data = spec.make_inputs(spec.small_config, 0)
    base = BACKPLAN_KINDS[spec.kind][0]

    def loss(params, x):
        return base(params, x, **spec.static)

    params = {k: bp.tensor(v) for k, v in data.params.items()}
    args = [params, *(bp.tensor(b) for b in data.batch(True))]
    vg = bp.value_and_grad(loss)
    with use_backend("numba"):
        source = vg.trace(*args).runner().compiled.source
        value, grads = vg(*args)
    assert "attention_forward" in source and "ascontiguousarray" not in source
    monkeypatch.setenv("BACKPLAN_FUSE_ATTENTION", "0")
    with use_backend("reference"):
        want, want_grads = bp.value_and_grad(loss)(*args)
    np.testing.assert_allclose(value.numpy(), want.numpy(), rtol=1e-11)
    for name, grad in grads.items():
        np.testing.assert_allclose(grad.numpy(), want_grads[name].numpy(), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_bfloat16_query_key_and_value_are_taken_as_torch_takes_them(causal):
    """bfloat16's NumPy kind is 'V', so the one-float-dtype check refused three bfloat16 inputs
    ('need one float dtype, got bfloat16, bfloat16, bfloat16'). The result is the float32
    attention of the same (bfloat16) values, rounded once; a mixed dtype is still refused."""
    rng = np.random.default_rng(5)
    q, k, v = (bp.tensor(rng.standard_normal((2, 3, 7, 8)).astype(np.float32)) for _ in range(3))
    q, k, v = (t.astype(bp.bfloat16) for t in (q, k, v))
    wide = [t.astype(bp.float32).numpy() for t in (q, k, v)]
    want = np_attention(*wide, 8**-0.5, causal)
    for run in (bp.scaled_dot_product_attention, bp.compile(bp.scaled_dot_product_attention)):
        out = run(q, k, v, is_causal=causal)
        assert out.dtype == bp.bfloat16
        np.testing.assert_allclose(out.astype(bp.float32).numpy(), want, rtol=2**-8, atol=1e-6)
    with pytest.raises(bp.DtypeError, match="bfloat16, float32, bfloat16"):
        bp.scaled_dot_product_attention(q, k.astype(bp.float32), v)
