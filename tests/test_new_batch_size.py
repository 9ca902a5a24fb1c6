"""A new batch size of a symbolic plan (tracer/dynamic.py) costs its first call little: no kernel
compiled, no listing of the kernel folder for a compile estimate, the loop kernels renamed once
(codegen/render/kernel_source.py), the IR comments of a driver another size renders not made
again (codegen/render/emit.py), and the values those of the reference interpreter at every
size, an empty batch and special values included."""

import numpy as np
import pytest

import backplan as bp
from backplan.codegen.build import kernel_cache
from backplan.codegen.render import emit, kernel_source
from backplan.runtime.backend import use_backend

RNG = np.random.default_rng(3)
W = bp.tensor(RNG.standard_normal((5, 3)).astype(np.float32), requires_grad=True)


def loss(w, x):
    h = bp.tanh(x @ w)
    return bp.mean(bp.softmax(h, axis=-1) * h) + bp.sum(h * h)


def batch(n: int, special: bool = False):
    x = RNG.standard_normal((n, 5)).astype(np.float32)
    if special and n >= 2:
        x[0, 1], x[1, 3] = np.inf, np.nan
    return bp.tensor(x)


def reference(x):
    with use_backend("reference"):
        value, grad = bp.value_and_grad(loss)(W, x)
    return value.numpy(), grad.numpy()


def assert_reference(step, x) -> None:
    value, grad = step(W, x)
    expected_value, expected_grad = reference(x)
    np.testing.assert_allclose(value.numpy(), expected_value, rtol=1e-5, equal_nan=True)
    np.testing.assert_allclose(grad.numpy(), expected_grad, rtol=1e-4, atol=1e-6, equal_nan=True)


def test_a_new_size_lists_no_kernel_folder_and_makes_no_ir_comments(monkeypatch):
    step = bp.value_and_grad(bp.compile(loss, dynamic={"x": {0: "batch"}}))
    with use_backend("numba"):
        assert_reference(step, batch(4))
        first = step.trace(W, batch(4)).runner().compiled
        listed, comments = [], []
        listing, comment = kernel_cache._indexed_kernel_names, emit.ir_comment
        monkeypatch.setattr(
            kernel_cache, "_indexed_kernel_names", lambda *a: listed.append(a) or listing(*a)
        )
        monkeypatch.setattr(emit, "ir_comment", lambda *a: comments.append(a) or comment(*a))
        before = kernel_cache.counts()
        for n in (7, 11, 6):
            assert_reference(step, batch(n))
        later = step.trace(W, batch(11)).runner().compiled
    assert listed == [] and comments == []
    assert kernel_cache.counts().versions == before.versions
    assert later.source == first.source and "# %" in later.source  # the first size's comments
    assert later._compiled_run is first._compiled_run
    assert step.cache_info().traces == 1


@pytest.mark.parametrize("sizes", [(4, 9, 0, 13), (3, 2, 8)])
def test_every_size_after_the_first_gives_the_reference_values_special_values_included(sizes):
    step = bp.value_and_grad(bp.compile(loss, dynamic={"x": {0: "batch"}}))
    with use_backend("numba"):
        for n in sizes:
            x = batch(n, special=True)
            assert_reference(step, x)
            assert_reference(step, x)  # the second call: the driver its first call chose


def test_a_kernel_renamed_again_is_the_kernel_renamed_afresh_with_this_calls_sizes():
    lines = ["w0 = contiguous_view(b0, o0, n0)", "for i in range(n0):", "    w0[i] = 2.0 * w0[i]"]
    bases = {"b0": "scratch_f32"}
    first = kernel_source.canonical_kernel(lines, {"o0": 0, "n0": 12}, bases, False, "salt")
    again = kernel_source.canonical_kernel(lines, {"o0": 48, "n0": 30}, bases, False, "salt")
    kernel_source._RENAMED.clear()
    fresh = kernel_source.canonical_kernel(lines, {"o0": 48, "n0": 30}, bases, False, "salt")
    assert again == fresh and again.digest == first.digest
    assert "np.intp(30)" in again.arguments and "np.intp(48)" in again.arguments
    assert "np.intp(12)" in first.arguments
    other = kernel_source.canonical_kernel(lines, {"o0": 0, "n0": 12}, bases, False, "other")
    assert other.digest != first.digest  # the salt is part of what is kept


def _fresh(*args, **kwargs):
    kernel_source._RENAMED.clear()
    kernel_source._PARAMETERS_APART.clear()
    return kernel_source.canonical_kernel(*args, **kwargs)


def test_a_loop_seen_with_other_float_literals_is_that_kernel_with_these_as_arguments():
    """A mean's 1/n at another batch size: the loop is not renamed again when every float
    literal of it is a parameter; its kernel, digest and arguments are those renamed afresh,
    the literal values this call's (the two equal ones one parameter, as renaming makes them)."""

    def lines(scale, shift):
        return [
            "w0 = contiguous_view(b0, o0, n0)",
            "for i in range(n0):",
            f"    w0[i] = w0[i] * np.float32({scale}) + np.float32({shift}) * np.float32({scale})",
        ]

    bases = {"b0": "scratch_f32"}
    dtype = {"scratch_f32": "np.float32"}.get
    first = _fresh(lines(0.125, 0.5), {"o0": 0, "n0": 8}, bases, False, "salt", dtype_of=dtype)
    assert "np.float32(0.125)" in first.arguments and "c0_f32" in first.source
    renamed = []
    original = kernel_source._renamed

    def counting(*args, **kwargs):
        renamed.append(args)
        return original(*args, **kwargs)

    kernel_source._renamed = counting
    try:
        again = kernel_source.canonical_kernel(
            lines(0.0833, 0.5), {"o0": 64, "n0": 12}, bases, False, "salt", dtype_of=dtype
        )
        assert not renamed  # found: the same loop, other values
        # two literals equal at one size and not at another: another loop, renamed
        other = kernel_source.canonical_kernel(
            lines(0.5, 0.5), {"o0": 64, "n0": 12}, bases, False, "salt", dtype_of=dtype
        )
        assert len(renamed) == 1
    finally:
        kernel_source._renamed = original
    fresh = _fresh(lines(0.0833, 0.5), {"o0": 64, "n0": 12}, bases, False, "salt", dtype_of=dtype)
    assert again == fresh and again.digest == first.digest
    assert "np.float32(0.0833)" in again.arguments and "np.float32(0.125)" not in again.arguments
    assert other == _fresh(
        lines(0.5, 0.5), {"o0": 64, "n0": 12}, bases, False, "salt", dtype_of=dtype
    )
    assert other.arguments.count("np.float32(0.5)") == 1


def test_a_loop_keeping_its_float_literals_in_its_code_is_renamed_at_each_value():
    """A parallel loop (or one whose arrays' dtypes are unknown) keeps its literals in its
    code: another value is another kernel, never the first one's."""
    lines = ["w0 = contiguous_view(b0, o0, n0)", "for i in range(n0):"]
    bases = {"b0": "scratch_f32"}
    for parallel in (False, True):
        first = _fresh(
            [*lines, "    w0[i] = np.float32(0.125) * w0[i]"], {"o0": 0, "n0": 8}, bases,
            parallel, "salt",
        )  # fmt: skip
        again = kernel_source.canonical_kernel(
            [*lines, "    w0[i] = np.float32(0.25) * w0[i]"], {"o0": 0, "n0": 8}, bases,
            parallel, "salt",
        )  # fmt: skip
        assert first.digest != again.digest
        assert "np.float32(0.25)" in again.source and "np.float32(0.125)" in first.source


def test_a_mean_over_the_batch_renames_no_loop_at_later_sizes_and_gives_the_reference_values(
    monkeypatch,
):
    """The mean's 1/n is a float literal of a loop that differs at every size: from the third
    size on no loop is renamed (its kernel found with the literal apart) and every size's values
    are the reference interpreter's, special values included."""
    step = bp.value_and_grad(bp.compile(loss, dynamic={"x": {0: "batch"}}))
    renamed = []
    original = kernel_source._renamed
    monkeypatch.setattr(
        kernel_source, "_renamed", lambda *a, **k: renamed.append(a) or original(*a, **k)
    )
    with use_backend("numba"):
        for n in (4, 7):
            assert_reference(step, batch(n, special=True))
        renamed.clear()
        for n in (11, 6, 23, 7):
            assert_reference(step, batch(n, special=True))
            assert_reference(step, batch(n))
    assert renamed == []
    assert step.cache_info().traces == 1


@pytest.mark.parametrize("backend", ["reference", "numba"])
def test_a_constant_slice_on_the_batch_axis_never_reads_past_a_smaller_size(backend):
    """x[:4], x[-4:] and x[3] fitted at sizes 8, 16, 24 hold constant bounds; at 3 or 2 rows
    the fitted plan would read past the argument (rows of the array it views): such a size is
    traced on its own, clamped as NumPy slices, and x[3] raises eager's IndexError."""
    w = np.eye(6, dtype=np.float32)
    big = np.arange(600, dtype=np.float32).reshape(100, 6)  # rows past n: real, known memory
    functions = {
        "head": (lambda x, w: x[:4] @ w, lambda x: x[:4]),
        "tail": (lambda x, w: x[-4:] @ w, lambda x: x[-4:]),
        "row": (lambda x, w: x[3] @ w, lambda x: x[3]),
        "back": (lambda x, w: x[4::-1] @ w, lambda x: x[4::-1]),  # 4 rows: start 4 = size
        "skip": (lambda x, w: x[5:] @ w, lambda x: x[5:]),  # a negative length below 5
    }
    with use_backend(backend):
        for name, (fn, expected) in functions.items():
            f = bp.compile(fn)
            for n in (8, 12, 4, 3, 3, 2):
                x = big[:n]
                if name == "row" and n <= 3:
                    with pytest.raises(IndexError, match="index 3 is out of range"):
                        f(x, w)
                    continue
                got = np.asarray(f(x, w))
                np.testing.assert_array_equal(got, expected(x), err_msg=f"{name} at {n} rows")
