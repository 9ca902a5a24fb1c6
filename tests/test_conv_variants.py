"""The library's conv kernels compile one variant per dtype and rank: every array they only
read is passed read-only (codegen/kernels/conv.as_read_only), whether it is the caller's input
(read-only) or an intermediate (writable). Before, a two-layer CNN compiled conv2d_gemm twice.
The placed BLAS GEMM (gemm_at_f32) compiles one variant per dtype: before, a small MLP's step
compiled it five times (literal transpose flags, an input's rank, writable operands)."""

import numpy as np
import pytest

import backplan as bp
from backplan.codegen.kernels import conv, matmul
from backplan.runtime.backend import use_backend


def two_convs(w1, w2, x):
    hidden = bp.relu(bp.conv2d(x, w1, padding=(1, 1)))
    return bp.sum(bp.conv2d(hidden, w2, padding=(1, 1)) ** 2)


@pytest.mark.parametrize("driver", ["inline", "python"])
def test_inputs_and_intermediates_share_one_compiled_conv_variant(driver, monkeypatch, tmp_path):
    monkeypatch.setenv("BACKPLAN_DRIVER", driver)
    monkeypatch.setenv("BACKPLAN_CACHE_DIR", str(tmp_path))  # a cached driver calls no kernel
    rng = np.random.default_rng(3)
    w1 = bp.tensor(rng.standard_normal((3, 2, 3, 3)).astype(np.float32))
    w2 = bp.tensor(rng.standard_normal((4, 3, 3, 3)).astype(np.float32))
    x = bp.tensor(rng.standard_normal((2, 2, 5, 5)).astype(np.float32))
    with use_backend("numba"):
        value, grads = bp.value_and_grad(bp.compile(two_convs), argnums=(0, 1))(w1, w2, x)
    expected, expected_grads = bp.value_and_grad(two_convs, argnums=(0, 1))(w1, w2, x)
    np.testing.assert_allclose(value.numpy(), expected.numpy(), rtol=1e-4)
    for got, want in zip(grads, expected_grads, strict=True):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-4)
    for kernel in (conv.conv2d_gemm, conv.conv2d_input_grad_gemm, conv.conv2d_weight_grad_gemm):
        read = [signature[:2] for signature in kernel.signatures]
        assert read and all(not t.mutable for pair in read for t in pair), kernel.signatures


def test_attention_reads_read_only_queries_keys_values_and_gradients(monkeypatch, tmp_path):
    from backplan.codegen.kernels import attention

    monkeypatch.setenv("BACKPLAN_CACHE_DIR", str(tmp_path))  # a cached driver calls no kernel
    rng = np.random.default_rng(5)
    q = bp.tensor(rng.standard_normal((2, 4, 8)).astype(np.float32))
    w = bp.tensor(rng.standard_normal((8, 8)).astype(np.float32))

    def loss(q, w):
        kv = bp.tanh(q @ w)  # keys and values: intermediates (writable)
        return bp.sum(bp.scaled_dot_product_attention(q, kv, kv) ** 2)

    with use_backend("numba"):
        value, grads = bp.value_and_grad(bp.compile(loss), argnums=(0, 1))(q, w)
    expected, expected_grads = bp.value_and_grad(loss, argnums=(0, 1))(q, w)
    np.testing.assert_allclose(value.numpy(), expected.numpy(), rtol=1e-4)
    for got, want in zip(grads, expected_grads, strict=True):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-4)
    forward = [attention.attention_forward, attention.attention_forward_par]
    backward = [attention.attention_backward, attention.attention_backward_par]
    read = [s[1:4] for k in forward for s in k.signatures]
    read += [s[1:5] for k in backward for s in k.signatures]
    assert read and all(not t.mutable for group in read for t in group), read


@pytest.mark.parametrize("driver", ["inline", "python"])
def test_every_placed_gemm_of_a_training_step_shares_one_compiled_variant(
    driver, monkeypatch, tmp_path
):
    """Forward products read the caller's 2-D input and an intermediate in the arena; the
    backward's transpose x^T @ g and g @ w^T: one gemm_at_f32 for all of them."""
    monkeypatch.setenv("BACKPLAN_DRIVER", driver)
    monkeypatch.setenv("BACKPLAN_CACHE_DIR", str(tmp_path))  # a cached driver calls no kernel
    rng = np.random.default_rng(4)
    w1, w2 = (bp.tensor(rng.standard_normal(s).astype(np.float32)) for s in [(6, 5), (5, 3)])
    x = rng.standard_normal((4, 6)).astype(np.float32)

    def loss(w1, w2, x):
        return bp.sum(bp.tanh(bp.tanh(x @ w1) @ w2) ** 2)

    with use_backend("numba"):
        value, grads = bp.value_and_grad(bp.compile(loss), argnums=(0, 1))(w1, w2, x)
    expected, expected_grads = bp.value_and_grad(loss, argnums=(0, 1))(w1, w2, x)
    np.testing.assert_allclose(value.numpy(), expected.numpy(), rtol=1e-5)
    for got, want in zip(grads, expected_grads, strict=True):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-5)
    assert len(matmul.gemm_at_f32.signatures) == 1, matmul.gemm_at_f32.signatures
