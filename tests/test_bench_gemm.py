"""The GEMM harness's yardstick: the FMA peak probe computes what it counts, and the table
reports backplan's share of that peak."""

import numpy as np
import pytest

from backplan.bench import gemm
from backplan.bench.peak_flops import ACCUMULATORS, fma_chain


@pytest.mark.parametrize("lanes", [8, 16])
def test_fma_chain_runs_every_counted_fma(lanes):
    scale, shift, steps = np.float32(0.999), np.float32(1e-3), 37
    acc = shift
    for _ in range(steps):
        acc = np.float32(acc * scale + shift)
    expected = np.float32(ACCUMULATORS * lanes) * acc
    got = fma_chain(lanes)(steps, scale, shift)
    assert got == pytest.approx(float(expected), rel=1e-5)
    assert fma_chain(lanes)(steps + 5, scale, shift) != pytest.approx(float(expected), rel=1e-5)


def test_table_reports_share_of_peak_and_own_over_blas():
    results = {"mlp fwd": {"backplan": [90.0, 100.0, 110.0], "openblas": [50.0, 50.0, 50.0]}}
    table = gemm.format_table(results, peak=200.0)
    header, row = table.splitlines()
    assert header.split()[-2:] == ["own/blas", "own/peak"]
    assert row.split()[-2:] == ["2.00", "50%"]
    assert "own/peak" not in gemm.format_table(results)


def test_table_at_two_threads_shows_the_gain_over_one_thread():
    """ "bp 1 thread" (2-D shapes only at T > 1): own/1t is backplan over it, a dash without."""
    results = {
        "mlp fwd": {"backplan": [180.0], "openblas": [90.0], "bp 1 thread": [100.0]},
        "attn": {"backplan": [150.0], "openblas": [100.0]},
    }
    header, mlp, attn = gemm.format_table(results).splitlines()
    assert header.split()[-1] == "own/1t"
    assert mlp.split()[-1] == "1.80" and attn.split()[-1] == "-"
    assert attn.split()[-3] == "-" and attn.split()[-2] == "1.50"


def test_table_puts_own_over_torch_and_torchs_share_of_peak_beside_backplans():
    results = {"mlp fwd": {"backplan": [200.0], "openblas": [100.0], "torch": [160.0]}}
    header, row = gemm.format_table(results, peak=250.0).splitlines()
    assert header.split()[-4:] == ["own/blas", "own/torch", "own/peak", "torch/peak"]
    assert row.split()[-4:] == ["2.00", "1.25", "80%", "64%"]


def test_explains_gemm_words_name_the_path_the_harness_times():
    from backplan.bench.model_gemms import path_of

    assert path_of("backplan's GEMM + epilogue") == "own"
    assert path_of("backplan's GEMM on 2 cores") == "own x2"
    assert path_of("backplan's batched GEMM") == "own"
    assert path_of("backplan's narrow GEMM") == "narrow"
    assert path_of("BLAS sgemm") == "blas"
    with pytest.raises(ValueError, match="no GEMM path"):
        path_of("")


def test_every_product_of_the_mlp_step_is_a_shape_with_its_transposes_and_flops():
    """The mlp (784-512-512-10, batch 128): three forward products, the backward's three
    weight gradients (A^T @ B) and two input gradients (B^T read in place, none for x); their
    FLOPs are the step's GEMM FLOPs, each product once."""
    from backplan.bench.model_gemms import model_shapes

    shapes = [shape for _, shape in model_shapes("mlp")]
    flops = sum(2 * s.m * s.k * s.n for s in shapes)
    layers = [(784, 512), (512, 512), (512, 10)]
    expected = sum(2 * 128 * i * o for i, o in layers) * 3 - 2 * 128 * 784 * 512
    assert flops == expected and len(shapes) == 8
    assert {(s.m, s.k, s.n) for s in shapes if s.trans_a and not s.trans_b} == {
        (784, 128, 512), (512, 128, 512), (512, 128, 10)
    }  # fmt: skip
    assert {(s.m, s.k, s.n) for s in shapes if s.trans_b and not s.trans_a} == {
        (128, 512, 512), (128, 10, 512)
    }  # fmt: skip
    paths = ("own", "narrow", "row dots", "blas")  # "own xN" on N cores (the box's threads)
    assert all(s.batch == 0 and s.path.split(" x")[0] in paths for s in shapes)


def test_a_cnn_step_lists_its_convolutions_products():
    """The three im2col products of each conv layer (forward, input and weight gradients;
    the first layer's input gradient is not computed) with conv.py's transposes."""
    from backplan.bench.model_gemms import model_shapes

    convs = [(what.split()[0], s) for what, s in model_shapes("cnn") if what.startswith("conv")]
    ops = sorted(op for op, _ in convs)
    assert ops == ["conv2d", "conv2d", "conv2d_input_grad"] + ["conv2d_weight_grad"] * 2
    flags = {op: (s.trans_a, s.trans_b) for op, s in convs}
    assert flags == {"conv2d": (False, False), "conv2d_input_grad": (True, False),
                     "conv2d_weight_grad": (False, True)}  # fmt: skip
    # the second layer's forward: weights (32, 16*9) @ columns (16*9, 32*4*4)
    assert any((s.m, s.k, s.n) == (32, 144, 512) for op, s in convs if op == "conv2d")
    from backplan.codegen.kernels.gemm.isa import vector_width

    if vector_width() == 512:  # the first layer's weight gradient, 16 x 9 over k = 2048
        (first,) = [s for op, s in convs if op == "conv2d_weight_grad" and s.n == 9]
        assert (first.m, first.k, first.path) == (16, 2048, "row dots")


def test_attention_products_are_timed_on_the_gemm_the_kernel_runs(monkeypatch):
    """The attention kernel's products: the own GEMM on one core, side by side on N threads
    (its parallel variant), or BLAS (width 0): the harness times that, not always one core."""
    from types import SimpleNamespace

    from backplan.bench import internals, model_gemms

    monkeypatch.setattr(internals, "threads", lambda: 2, raising=False)
    node = SimpleNamespace(op="attention")
    for variant, path in [(("attention", 512), "own"), (("attention_par", 256), "own x2"),
                          (("attention", 0), "blas")]:  # fmt: skip
        monkeypatch.setattr(
            internals, "attention_variant", lambda fn, n, v=variant: v, raising=False
        )
        assert model_gemms.attention_path(node) == path
