"""A driver running as Python calls a loop over few elements compiled quickly (LLVM level 1,
no vectorisers: codegen/flags.py SMALL_LOOP_ELEMENTS) and a bigger one fully optimised, with
the same results as the reference interpreter; a small call takes the full loop where that
one is compiled already, so a model resized smaller compiles nothing."""

import numpy as np
import pytest

import backplan as bp
from backplan.codegen.build import kernel_cache
from backplan.codegen.flags import SMALL_LOOP_ELEMENTS
from backplan.runtime.backend import use_backend


@pytest.fixture(autouse=True)
def python_driver(monkeypatch, tmp_path):
    """The driver runs as Python (its loops through their address forms) and every kernel is
    compiled afresh: the cache folder is new and each test's loop body is its own."""
    monkeypatch.setenv("BACKPLAN_DRIVER", "python")
    monkeypatch.setenv("BACKPLAN_CACHE_DIR", str(tmp_path))


def shifted_tanh_sum(x):
    return bp.sum(bp.tanh(x) * 1.0625 + 0.8125)


def scaled_sigmoid_sum(x):
    return bp.sum(bp.sigmoid(x) * 0.6875 - 0.1875)


def gradient_checked(loss, shape, seed=0):
    """loss's compiled value and gradient at a random x of this shape holding nan, inf and
    -inf, checked against the reference interpreter; the plan's loop kernels."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    x.reshape(-1)[:3] = [np.nan, np.inf, -np.inf]
    with use_backend("numba"):
        vg = bp.value_and_grad(loss)
        value, grad = vg(bp.tensor(x))
        kernels = vg.trace(bp.tensor(x)).runner().compiled.loop_kernels
    with use_backend("reference"):
        expected, expected_grad = bp.value_and_grad(loss)(bp.tensor(x))
    np.testing.assert_allclose(value.numpy(), expected.numpy(), rtol=1e-5)
    np.testing.assert_allclose(grad.numpy(), expected_grad.numpy(), rtol=1e-5, atol=1e-6)
    assert np.isnan(grad.numpy().reshape(-1)[0])  # nan kept its meaning
    return kernels


def compiled_forms(kernels) -> dict[str, list]:
    """The code library of each address loop form the plan's calls ran (a loop compiled alone
    or with the plan's others: codegen/build/loop_batch.py), over all of its address kernels."""
    found = {"kernel_at": [], "kernel_at_small": []}
    for kernel in kernels:
        call = kernel_cache.python_call(kernel_cache.kernel(kernel.digest))
        for small, form in ((False, "kernel_at"), (True, "kernel_at_small")):
            if call._libraries[small] is not None:
                found[form].append(call._libraries[small])
    return found


def small_call(kernel):
    return kernel_cache.python_call(kernel_cache.kernel(kernel.digest))


def test_small_calls_run_a_loop_compiled_without_vectorisers():
    small = (3, 5)
    assert np.prod(small) <= SMALL_LOOP_ELEMENTS
    forms = compiled_forms(gradient_checked(shifted_tanh_sum, small))
    assert forms["kernel_at_small"] and not forms["kernel_at"]
    for library in forms["kernel_at_small"]:
        assert type(library).__name__ == "Level1CodeLibrary"
        assert " x float>" not in library.get_llvm_str()  # no vector of floats


def test_large_calls_run_the_vectorised_loop_and_small_calls_then_share_it():
    large = (96, 64)
    assert np.prod(large) > SMALL_LOOP_ELEMENTS
    kernels = gradient_checked(scaled_sigmoid_sum, large)
    forms = compiled_forms(kernels)
    assert any(" x float>" in library.get_llvm_str() for library in forms["kernel_at"])
    full = {k.digest for k in kernels if small_call(k)._libraries[False] is not None}

    resized = gradient_checked(scaled_sigmoid_sum, (5, 7), seed=1)
    assert {k.digest for k in resized} >= full  # the same loop bodies
    for kernel in resized:
        if kernel.digest in full:  # its full loop was there: the small form never compiled
            assert not kernel_cache.compiled_forms(kernel.digest)[1].overloads
            assert small_call(kernel)._libraries[True] is None


def bf16_layer_norm_gelu_sum(x):
    return bp.sum(bp.gelu(bp.layer_norm(x), approximate="tanh") * 0.75)


def test_large_loops_converting_16_bit_values_or_summing_rows_are_interleaved():
    """A big loop that loads or stores bfloat16, or sums into a scalar (layer norm's row sums,
    the loss), is optimised with interleaving (several vectors in flight:
    loop_optimisation.INTERLEAVED_LOOP); a float32 loop that does neither keeps the plain
    level-2 pipeline, so its compile is unchanged. Values match the reference interpreter."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((48, 128)).astype(np.float32)
    x[0, :3] = [np.nan, np.inf, -np.inf]
    kinds = {}  # (dtype, whether the loop converts or sums) -> library class names
    for dtype in (np.float32, bp.bfloat16):
        with use_backend("numba"):
            vg = bp.value_and_grad(bf16_layer_norm_gelu_sum)
            value, grad = vg(bp.tensor(x.astype(dtype)))
            kernels = vg.trace(bp.tensor(x.astype(dtype))).runner().compiled.loop_kernels
        with use_backend("reference"):
            expected, expected_grad = bp.value_and_grad(bf16_layer_norm_gelu_sum)(
                bp.tensor(x.astype(dtype))
            )
        assert grad.dtype == dtype
        assert np.isnan(value.numpy().astype(np.float32))  # the nan row reaches the sum
        got, want = grad.numpy().astype(np.float32), expected_grad.numpy().astype(np.float32)
        assert np.isnan(got[0]).all() and np.isnan(want[0]).all()  # the row holding nan
        tolerance = 1e-5 if dtype is np.float32 else 2e-2
        np.testing.assert_allclose(got[1:], want[1:], rtol=tolerance, atol=tolerance)
        for kernel in kernels:
            interleaved = "@njit(**INTERLEAVED_LOOP_KERNEL_JIT_OPTIONS)" in kernel.source
            names = {type(lib).__name__ for lib in compiled_forms([kernel])["kernel_at"]}
            kinds.setdefault((dtype, interleaved), set()).update(names)
    assert kinds[(bp.bfloat16, True)] == {"Level2InterleavedCodeLibrary"}
    assert kinds[(np.float32, True)] == {"Level2InterleavedCodeLibrary"}  # the row sums
    with use_backend("numba"):  # elementwise, no scalar sum
        fn = bp.compile(lambda x: bp.tanh(x) * 1.0625 + 0.8125)
        fn(bp.tensor(x))
        kernels = [k for r in fn.trace(bp.tensor(x)).runners() for k in r.compiled.loop_kernels]
    plain = [k for k in kernels if "@njit(**INTERLEAVED_LOOP" not in k.source]
    assert plain, "the elementwise loop was interleaved"
    assert {type(lib).__name__ for lib in compiled_forms(plain)["kernel_at"]} == {
        "Level2CodeLibrary"
    }
