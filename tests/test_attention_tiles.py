"""Key-tiled attention (codegen/kernels/attention.py): keys beyond the tile run as an online
softmax in forward (a running max and sum per row, the output rows rescaled as the max grows)
and as two sweeps in backward. Small tiles here make short sequences take several tiles, last
ones partial, against NumPy in float64 and the same kernels with one tile; a plan whose keys
outnumber KEYS takes the tiled path end to end."""

import numpy as np
import pytest
from helpers import run_with_own_gemm_as_python
from op_samples import np_attention, np_attention_grad

import backplan as bp
from backplan.codegen.kernels import attention
from backplan.codegen.kernels.gemm import vector_width
from backplan.runtime.backend import use_backend

CASES = {
    # name: (heads, T, S, D, Dv, causal, tile)
    "four-tiles-last-partial": (2, 37, 50, 5, 3, False, 16),
    "causal-two-row-blocks": (1, 130, 70, 4, 4, True, 16),
    "causal-square": (1, 45, 45, 3, 2, True, 8),
    "causal-blocks-stop-early": (1, 200, 300, 3, 2, True, 64),
    "more-keys-than-queries": (3, 5, 61, 2, 3, True, 16),
}


def read_only(*arrays):
    """Read-only views, as compiled plans pass queries, keys, values and gradients: the kernels
    compile the variant plans use (tests/test_conv_variants.py checks every one is)."""
    views = tuple(a.view() for a in arrays)
    for view in views:
        view.setflags(write=False)
    return views


def inputs(rng, heads, t, s, d, dv, dtype):
    q, k, v = (
        rng.standard_normal((1, heads) + shape).astype(dtype) for shape in ((t, d), (s, d), (s, dv))
    )
    return q, k, v, rng.standard_normal((1, heads, t, dv)).astype(dtype)


def run_kernels(width, q, k, v, g, scale, causal, tile):
    out, dq, dk, dv = (np.empty(x.shape, q.dtype) for x in (g, q, k, v))
    q, k, v, g = read_only(q, k, v, g)
    work = attention.slot_workspace(q, k, v, tile)
    attention.attention_forward(width, q, k, v, out, scale, causal, tile, work)
    attention.attention_backward(width, q, k, v, g, dq, dk, dv, scale, causal, tile, work)
    return out, (dq, dk, dv)


def expected(q, k, v, g, scale, causal):
    """float64 NumPy attention and its gradients, per head."""
    q, k, v, g = (x[0].astype(np.float64) for x in (q, k, v, g))
    out = np_attention(q, k, v, scale, causal)
    flat = np_attention_grad(q, k, v, g, scale, causal)
    parts = np.split(flat, np.cumsum([q.size, k.size]))
    return out[None], [p.reshape((1,) + x.shape) for p, x in zip(parts, (q, k, v), strict=True)]


@pytest.mark.parametrize("width", [0, vector_width()], ids=["blas", "own-gemm"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_key_tiles_equal_numpy_and_one_tile(case, width):
    heads, t, s, d, dv, causal, tile = CASES[case]
    q, k, v, g = inputs(np.random.default_rng(7), heads, t, s, d, dv, np.float32)
    out, grads = run_kernels(width, q, k, v, g, 0.7, causal, tile)
    one_out, one_grads = run_kernels(width, q, k, v, g, 0.7, causal, s)  # every key one tile
    want_out, want_grads = expected(q, k, v, g, 0.7, causal)
    np.testing.assert_allclose(out, want_out, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(out, one_out, rtol=2e-5, atol=2e-6)
    for got, one, want in zip(grads, one_grads, want_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(got, one, rtol=1e-4, atol=2e-5)


def test_key_tiles_in_float64_keep_float64_accuracy():
    q, k, v, g = inputs(np.random.default_rng(8), 2, 33, 41, 3, 2, np.float64)
    out, grads = run_kernels(vector_width(), q, k, v, g, 0.6, True, 8)
    want_out, want_grads = expected(q, k, v, g, 0.6, True)
    np.testing.assert_allclose(out, want_out, rtol=1e-11, atol=1e-11)
    for got, want in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)


def test_a_large_score_in_a_late_tile_rescales_the_earlier_ones():
    """The running max grows in the last tile by far more than exp can hold unscaled: the rows
    from earlier tiles are rescaled, not lost or overflowed."""
    q, k, v, g = inputs(np.random.default_rng(9), 1, 6, 40, 2, 2, np.float32)
    k[0, 0, 35] *= 60.0  # scores of key 35 dwarf the rest for some rows, tiny for others
    out, grads = run_kernels(vector_width(), q, k, v, g, 1.0, False, 16)
    want_out, want_grads = expected(q, k, v, g, 1.0, False)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, want_out, rtol=1e-4, atol=1e-4)
    for got, want in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)


def test_nan_in_one_query_spoils_its_row_only_across_tiles():
    q, k, v, g = inputs(np.random.default_rng(10), 1, 9, 40, 3, 2, np.float32)
    q[0, 0, 4, 1] = np.nan
    out, (dq, _, _) = run_kernels(vector_width(), q, k, v, g, 0.5, False, 16)
    assert np.isnan(out[0, 0, 4]).all() and np.isnan(dq[0, 0, 4]).all()
    rows = [i for i in range(9) if i != 4]
    want_out, _ = expected(q, k, v, g, 0.5, False)
    np.testing.assert_allclose(out[0, 0, rows], want_out[0, 0, rows], rtol=2e-5, atol=2e-5)


def test_a_plan_with_more_keys_than_a_tile_runs_tiled_and_equals_the_reference():
    """S > KEYS: the compiled plan's kernels take the key-tiled path."""
    rng = np.random.default_rng(11)
    s = attention.KEYS + 77
    q, k, v, g = (
        rng.standard_normal(shape).astype(np.float32)
        for shape in [(2, 9, 3), (2, s, 3), (2, s, 2), (2, 9, 2)]
    )

    def loss(q, k, v, g):
        out = bp.scaled_dot_product_attention(q, k, v, is_causal=False, scale=0.8)
        return bp.sum(out * g), out

    results = {}
    for backend in ("reference", "numba"):
        with use_backend(backend):
            fn = bp.value_and_grad(bp.compile(loss), argnums=(0, 1, 2), has_aux=True)
            (_, out), grads = fn(*(bp.tensor(x) for x in (q, k, v, g)))
        results[backend] = [out.numpy()] + [d.numpy() for d in grads]
    for got, ref in zip(results["numba"], results["reference"], strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)


TILED_PATH_SCRIPT = """
import numpy as np
from backplan.codegen.kernels import attention
from backplan.codegen.kernels.gemm import vector_width

calls = []
for name in ("_forward_tiled", "_backward_tiled"):
    kernel = getattr(attention, name)
    setattr(attention, name, lambda *a, _k=kernel, _n=name: (calls.append(_n), _k(*a))[1])
rng = np.random.default_rng(3)
q, k, v, g = (rng.standard_normal((1, 2, 9, 3)).astype(np.float32) for _ in range(4))
out, dq, dk, dv = (np.empty_like(q) for _ in range(4))
for tile in (4, 9):
    work = attention.slot_workspace(q, k, v, tile)
    attention.attention_forward(vector_width(), q, k, v, out, 0.5, True, tile, work)
    attention.attention_backward(vector_width(), q, k, v, g, dq, dk, dv, 0.5, True, tile, work)
    print(tile, sorted(set(calls)), float(np.abs(out).sum()), float(np.abs(dk).sum()))
    calls.clear()
"""


def test_keys_beyond_the_tile_take_the_tiled_path_and_one_tile_does_not(tmp_path):
    """The kernels as plain Python, their tiled paths wrapped: 9 keys in tiles of 4 go through
    both sweeps, in one tile of 9 through neither, with the same results."""
    lines = run_with_own_gemm_as_python(TILED_PATH_SCRIPT, tmp_path).split("\n")
    tiled, whole = (line.split(" ", 1) for line in lines[:2])
    assert tiled[0] == "4" and tiled[1].startswith("['_backward_tiled', '_forward_tiled']")
    assert whole[0] == "9" and whole[1].startswith("[] ")
    tiled_sums = [float(x) for x in tiled[1].split("] ")[1].split()]
    whole_sums = [float(x) for x in whole[1].split("] ")[1].split()]
    np.testing.assert_allclose(tiled_sums, whole_sums, rtol=1e-5)


def test_parallel_kernels_take_the_key_tiles_too():
    """The (batch, head)-parallel variants call the same head kernels with the tile, each
    slot of the workspace (a thread's) holding its pairs' tiles."""
    q, k, v, g = inputs(np.random.default_rng(12), 3, 21, 40, 3, 2, np.float32)
    q, k, v, g = read_only(*(np.concatenate([x, x[:, ::-1]]) for x in (q, k, v, g)))  # 2 batch
    out, dq, dk, dv = (np.empty(x.shape, np.float32) for x in (g, q, k, v))
    work = attention.slot_workspace(q, k, v, 16, slots=2)
    per = work.shape[0] // 2
    attention.attention_forward_par(vector_width(), q, k, v, out, 0.7, True, 16, work, per)
    attention.attention_backward_par(
        vector_width(), q, k, v, g, dq, dk, dv, 0.7, True, 16, work, per
    )
    for b in range(2):
        one = [x[b : b + 1] for x in (q, k, v, g)]
        want_out, want_grads = expected(*one, 0.7, True)
        np.testing.assert_allclose(out[b : b + 1], want_out, rtol=2e-5, atol=2e-5)
        for got, want in zip((dq, dk, dv), want_grads, strict=True):
            np.testing.assert_allclose(got[b : b + 1], want, rtol=1e-4, atol=1e-4)
