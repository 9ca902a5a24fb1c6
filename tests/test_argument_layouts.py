"""Arguments in another layout than C order. An F-order one (a weight passed transposed, a
Fortran array) is read in place, as the transpose of its C-ordered .T (ir/in_place_inputs.py);
so are reversed, broadcast and sliced views (a column slice, every other row or column, mixed
kinds: a slice of a C-ordered span of the array they view). A view of no C-ordered array
("strided": a slice of an F-ordered one) is copied whole into C order on entry of each compiled
call (codegen/run/compiled.py), and explain's peak, the checked mode's prediction and the
signature all know it (ir/argument_layout.py, category "copies" in ir/peak.py). A misaligned
C-ordered array is read in place. Values and gradients against the reference interpreter on
the same arrays."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import backplan as bp
from backplan.codegen.run.memory_check import checked_memory, measure
from backplan.ir.argument_layout import SLICED, layout, stored_bytes
from backplan.ir.argument_layout import layout as argument_layout
from backplan.ir.peak import joint_calls, predicted_peak, region_calls
from backplan.runtime.backend import use_backend

RNG = np.random.default_rng(3)
W1 = RNG.standard_normal((8, 16)).astype(np.float32)
W2 = RNG.standard_normal((4, 16)).astype(np.float32)
X = RNG.standard_normal((5, 8)).astype(np.float32)


def loss(p, x):
    return bp.sum(bp.tanh(x @ p["w1"]) @ p["w2"].T)


def _strided(a: np.ndarray) -> np.ndarray:
    """a's values as every other column of an array the view does not know (DLPack, as a
    torch tensor's slice arrives): copied, its span unknown."""
    return np.from_dlpack(np.repeat(a, 2, axis=1)[:, ::2])


def _wider(a: np.ndarray, left: int, right: int) -> np.ndarray:
    """a's values as a column slice of a wider C-ordered array."""
    return np.pad(a, ((0, 0), (left, right)))[:, left : left + a.shape[1]]


def _misaligned(a: np.ndarray) -> np.ndarray:
    """a's values in a C-ordered array one byte off its element alignment."""
    out = np.ndarray(a.shape, a.dtype, buffer=bytearray(a.nbytes + 1), offset=1)
    out[...] = a
    return out


# (w1, w2, x) per layout, and the bytes a compiled call copies of them
# (w1, w2, x) per layout, the bytes a compiled call copies of them, and the bytes of those not
# in C order (a copy of each, at most, is what reading them in place can still need)
LAYOUTS = {
    "F-order": (
        lambda: (np.asfortranarray(W1), np.asfortranarray(W2), np.asfortranarray(X)),
        0,
        W1.nbytes + W2.nbytes + X.nbytes,
    ),
    "negative strides": (
        lambda: (
            np.ascontiguousarray(W1[::-1])[::-1],
            np.ascontiguousarray(W2[:, ::-1])[:, ::-1],
            X,
        ),
        0,
        W1.nbytes + W2.nbytes,
    ),
    "broadcast": (
        lambda: (np.broadcast_to(W1[0], W1.shape), W2, np.broadcast_to(X[1], X.shape)),
        0,
        W1.nbytes + X.nbytes,
    ),
    "strided": (lambda: (_strided(W1), W2, X), W1.nbytes, W1.nbytes),
    "column slice": (
        lambda: (_wider(W1, 3, 5), _wider(W2, 0, 7), _wider(X, 2, 0)),
        0,
        W1.nbytes + W2.nbytes + X.nbytes,
    ),
    "every other column": (
        lambda: (np.repeat(W1, 2, axis=1)[:, ::2], np.repeat(W2, 2, axis=1)[:, 1::2], X),
        0,
        W1.nbytes + W2.nbytes,
    ),
    "every other row": (
        lambda: (np.repeat(W1, 2, axis=0)[1::2], W2, np.repeat(X, 2, axis=0)[::2]),
        0,
        W1.nbytes + X.nbytes,
    ),
    "broadcast + reversed": (
        lambda: (np.broadcast_to(W1[2, ::-1], W1.shape), W2, np.broadcast_to(X[1, ::-1], X.shape)),
        0,
        W1.nbytes + X.nbytes,
    ),
    "permuted + reversed": (
        lambda: (np.asfortranarray(W1)[::-1], np.asfortranarray(W2)[:, ::-1], X),
        0,
        W1.nbytes + W2.nbytes,
    ),
    "misaligned": (lambda: (_misaligned(W1), W2, _misaligned(X)), 0, 0),
}
# read in place with nothing copied at all (a GEMM reads a reversed or broadcast operand only
# after a copy into the arena, ir/strided_copies.py: counted as scratch)
NO_COPY_AT_ALL = ("F-order", "misaligned")


def _reference(w1, w2, x):
    with use_backend("reference"):
        return bp.value_and_grad(loss)({"w1": w1, "w2": w2}, x)


def _close(got, want, tol=1e-4):
    value, grads = got
    want_value, want_grads = want
    np.testing.assert_allclose(np.asarray(value), np.asarray(want_value), rtol=tol, atol=tol)
    for k in want_grads:
        np.testing.assert_allclose(
            np.asarray(grads[k]), np.asarray(want_grads[k]), rtol=tol, atol=tol
        )


STEPS = {
    "compiled": lambda: bp.compile(bp.value_and_grad(loss)),
    "saved bf16": lambda: bp.compile(bp.value_and_grad(loss), saved_dtype=bp.bfloat16),
    "dynamic": lambda: bp.compile(bp.value_and_grad(loss), dynamic={"x": {0: "b"}}),
    "not compiled": lambda: bp.value_and_grad(loss),
}


@pytest.mark.parametrize("step_kind", sorted(STEPS))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_value_and_grad_step_counts_the_copies_it_makes(layout, step_kind):
    """The checked mode passes on every call (the copies are in the plan's prediction), the
    measured peak is explain's, and explain's peak holds the copies' bytes exactly."""
    make, copied, whole = LAYOUTS[layout]
    w1, w2, x = make()
    assert (layout == "misaligned") == all(a.flags.c_contiguous for a in (w1, w2, x))
    c_order = [np.ascontiguousarray(a) for a in (w1, w2, x)]
    args = ({"w1": w1, "w2": w2}, x)
    with use_backend("reference"):  # the same step on the reference interpreter
        want = STEPS[step_kind]()(*args)
    with use_backend("numba"), checked_memory():
        step = STEPS[step_kind]()
        tol = 1e-2 if step_kind == "saved bf16" else 1e-4  # fused loops round less often
        for _ in range(2):
            _close(step(*args), want, tol)
        with measure() as measured:
            got = step(*args)
        _close(got, want, tol)
        if step_kind != "saved bf16":  # rounded saved values: the reference's own rounding
            _close(got, _reference(w1, w2, x))
        report = step.explain(*args)
    assert report.call_peak.at_peak().get("copies", 0) == copied
    with use_backend("numba"):
        c_step = STEPS[step_kind]()
        c_args = ({"w1": c_order[0], "w2": c_order[1]}, c_order[2])
        c_step(*c_args)
        c_report = c_step.explain(*c_args).call_peak
    # the caller's arrays at the bytes they occupy (a broadcast one compact, a slice its span)
    stored = sum(stored_bytes(a.shape, a.itemsize, argument_layout(a)) for a in (w1, w2, x))
    assert report.call_peak.input_bytes == stored
    own, c_own = (r.peak_bytes - r.input_bytes for r in (report.call_peak, c_report))
    if layout in NO_COPY_AT_ALL or copied:
        assert own == c_own + copied  # in place: the C-order peak
    else:  # the C-order peak, or above it by a GEMM operand's copy into the arena
        assert c_own <= own < c_own + whole
    if step_kind == "not compiled":
        plan = step.trace(*args).plan
        predicted = predicted_peak(joint_calls(plan, 1))
    else:
        predicted = predicted_peak(region_calls(step.trace(*args).program.plans))
    assert measured.peak == predicted.allocated_peak_bytes == report.call_peak.allocated_peak_bytes


@pytest.mark.parametrize("layout", ["F-order", "negative strides"])
def test_a_compiled_loss_and_its_backward_count_the_copies_or_read_in_place(layout):
    """bp.compile(loss) then backward() on tensors sharing the arrays' memory (bp.from_dlpack,
    as a torch user's w.T arrives): the forward copies them, and the backward copies again the
    saved input that is the caller's array (read where it lives)."""
    make, copied, _ = LAYOUTS[layout]
    w1, w2, x = make()
    want = _reference(w1, w2, x)
    with use_backend("numba"), checked_memory():
        step = bp.compile(loss)
        p = {"w1": bp.from_dlpack(w1), "w2": bp.from_dlpack(w2)}
        assert not p["w1"].numpy().flags.c_contiguous
        for t in p.values():
            t.requires_grad = True
        xt = bp.tensor(x)
        measured = []
        for _ in range(4):  # calls 1-2 run a forward and a backward plan, then one joint plan
            with measure() as held:
                value = step(p, xt)
                value.backward()
            measured.append(held.peak)
            _close((value.numpy(), {k: t.grad.numpy() for k, t in p.items()}), want)
            for t in p.values():
                t.grad = None
        report = step.explain(p, xt)
    calls = region_calls(step.trace(p, xt).program.plans)
    assert [c.label for c in calls] == ["forward", "backward"]
    passed = [p["w1"].numpy(), p["w2"].numpy(), xt.numpy()]
    assert len(calls[0].copied) == sum(not a.flags.c_contiguous for a in passed)
    assert calls[1].copied  # x @ w2.T's gradient for x reads w2: saved, the caller's array
    copies = max(s.held.get("copies", 0) for s in predicted_peak(calls).steps)
    assert copies == copied == 0  # both read in place
    assert measured[1] == predicted_peak(calls).allocated_peak_bytes
    predicted = [report.peak_on_call(n).allocated_peak_bytes for n in (1, 2, 3, 4)]
    assert measured[1:] == predicted[1:]  # the first call also counts its compile's garbage
    assert report.peak_on_call(3).at_peak().get("copies", 0) == copied


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_compiled_forward_counts_or_reads_in_place(layout):
    make, copied, _ = LAYOUTS[layout]
    w1, w2, x = make()
    args = ({"w1": w1, "w2": w2}, x)
    with use_backend("numba"), checked_memory():
        step = bp.compile(loss)
        for _ in range(3):
            with measure() as measured:
                value = step(*args)
        report = step.explain(*args)
    np.testing.assert_allclose(value.numpy(), _reference(w1, w2, x)[0], rtol=1e-5, atol=1e-5)
    assert measured.peak == report.call_peak.allocated_peak_bytes
    assert report.call_peak.at_peak().get("copies", 0) == copied


def test_a_layout_change_retraces_and_says_so():
    """The signature keys on the layout: a plan whose peak counted a copy is not reused for a
    C-ordered array (nor the other way round), on the fast path too."""
    with use_backend("numba"), checked_memory():
        step = bp.compile(bp.value_and_grad(loss))
        c_args = ({"w1": W1, "w2": W2}, X)
        f_args = ({"w1": np.asfortranarray(W1), "w2": W2}, X)
        for args in (c_args, c_args, f_args, f_args, c_args, f_args):
            step(*args)  # the checked mode raises if a plan's prediction is reused wrongly
        reason = step.explain(*f_args).retrace_reason
        r_args = ({"w1": W1[::-1], "w2": W2}, X)
        s_args = ({"w1": _strided(W1), "w2": W2}, X)
        v_args = ({"w1": np.repeat(W1, 2, axis=1)[:, ::2], "w2": W2}, X)
        for args in (r_args, c_args, s_args, r_args, v_args, f_args, s_args, v_args):
            step(*args)
        assert step.explain(*s_args).call_peak.at_peak()["copies"] == W1.nbytes
        for args in (c_args, f_args, r_args, v_args):
            assert "copies" not in step.explain(*args).call_peak.at_peak()
        strided_text = " ".join(str(step.explain(*s_args)).split())
        sliced_text = " ".join(str(step.explain(*v_args)).split())
        text = " ".join(str(step.explain(*f_args)).split())  # the text wraps
        reversed_text = " ".join(str(step.explain(*r_args)).split())
    assert "read in place, no copy: p['w1'] (F-order) in the forward call" in text
    assert "read in place, no copy: p['w1'] (reversed along axis 0)" in reversed_text
    assert "copy of p['w1'] (strided) 512 B in the forward call" in strided_text
    assert "read in place, no copy: p['w1'] (sliced [0:8:1, 0:31:2] of a 8 x 32 array)" in (
        sliced_text
    )
    assert reason == "p['w1']: layout C -> F-order"


def test_the_reason_for_a_retrace_names_the_layout():
    from backplan.tracer.signature import bind_call, miss_reason

    def f(x):
        return x

    old = bind_call(f, (X,), {}).key
    new = bind_call(f, (np.asfortranarray(X),), {}).key
    assert old != new
    assert miss_reason(old, new) == "x: layout C -> F-order"
    assert bind_call(f, (_misaligned(X),), {}).key == old


def test_gradients_for_an_f_order_weight_read_in_place_match_finite_differences():
    """float64, a weight passed transposed (its C-ordered .T is what the plan reads)."""
    rng = np.random.default_rng(5)
    w = np.asfortranarray(rng.standard_normal((6, 5)))
    v = rng.standard_normal((5, 3))
    x = rng.standard_normal((4, 6))

    def f(w, v, x):
        return bp.sum(bp.tanh(x @ w) @ (v * w[0:3, :].T))

    with use_backend("numba"), checked_memory():
        step = bp.compile(bp.value_and_grad(f, argnums=(0, 1)))
        _, (gw, gv) = step(w, v, x)
        _, (gw, gv) = step(w, v, x)
        assert "read in place" in str(step.explain(w, v, x))

    def value(w):
        with use_backend("reference"):
            return float(f(w, v, x).numpy())

    eps, numeric = 1e-6, np.zeros_like(w)
    for i in np.ndindex(w.shape):
        up, down = np.array(w), np.array(w)
        up[i] += eps
        down[i] -= eps
        numeric[i] = (value(up) - value(down)) / (2 * eps)
    np.testing.assert_allclose(np.asarray(gw), numeric, rtol=1e-6, atol=1e-7)
    with use_backend("reference"):
        _, (rw, rv) = bp.value_and_grad(f, argnums=(0, 1))(np.ascontiguousarray(w), v, x)
    np.testing.assert_allclose(np.asarray(gw), np.asarray(rw), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.asarray(gv), np.asarray(rv), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout", ["F-order", "negative strides", "broadcast"])
def test_a_numpy_argument_saved_for_backward_keeps_its_prediction(layout):
    """x, a NumPy array the backward reads (x.T @ g): the fast path copies it for the backward
    in its own order (an F-order copy is read in place again), the checked mode passes."""
    x = {
        "F-order": np.asfortranarray(X),
        "negative strides": np.ascontiguousarray(X[::-1])[::-1],
        "broadcast": np.broadcast_to(X[1], X.shape),
    }[layout]
    with use_backend("reference"):
        p = {"w1": bp.tensor(W1, requires_grad=True), "w2": bp.tensor(W2, requires_grad=True)}
        bp.compile(loss)(p, np.ascontiguousarray(x)).backward()
        want = p["w1"].grad.numpy()
    with use_backend("numba"), checked_memory():
        step = bp.compile(loss)
        p = {"w1": bp.tensor(W1, requires_grad=True), "w2": bp.tensor(W2, requires_grad=True)}
        for _ in range(4):
            step(p, x).backward()
            np.testing.assert_allclose(p["w1"].grad.numpy(), want, rtol=1e-5, atol=1e-5)
            p["w1"].grad = p["w2"].grad = None


@pytest.mark.parametrize("perm", [(1, 0, 2), (1, 2, 0), (2, 1, 0)])
def test_a_permuted_argument_is_read_in_place_with_its_gradient(perm):
    """A torch-style .permute() of a contiguous 3-D array (F-order when all axes reverse):
    read as a transpose of the C-ordered array under it, its gradient against the reference."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 4, 5)).astype(np.float32)
    under = np.ascontiguousarray(x.transpose(np.argsort(perm)))
    permuted = under.transpose(perm)
    assert np.array_equal(permuted, x) and not permuted.flags.c_contiguous
    _read_in_place_with_gradients(permuted, rng)


def _read_in_place_with_gradients(x: np.ndarray, rng) -> None:
    """A 3-D argument x of shape (3, 4, 5), in its layout: values and gradients of a compiled
    step against the reference interpreter on the same array (checked mode on), no copy."""
    s = rng.standard_normal((3, 4, 5)).astype(np.float32)
    w = rng.standard_normal((5, 6)).astype(np.float32)

    def f(x, s, w):
        return bp.sum(bp.tanh(bp.tanh(x * s) @ w))

    with use_backend("reference"):
        want = bp.value_and_grad(f, argnums=(0, 2))(x, s, w)
    with use_backend("numba"), checked_memory():
        step = bp.compile(bp.value_and_grad(f, argnums=(0, 2)))
        for _ in range(3):
            value, (gx, gw) = step(x, s, w)
            np.testing.assert_allclose(float(value), float(want[0]), rtol=1e-5)
            np.testing.assert_allclose(np.asarray(gx), np.asarray(want[1][0]), rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(np.asarray(gw), np.asarray(want[1][1]), rtol=1e-4, atol=1e-5)
        report = step.explain(x, s, w)
    assert "copies" not in report.call_peak.at_peak()
    assert f"read in place, no copy: x ({layout(x)})" in " ".join(str(report).split())


def test_a_budget_counts_the_copies_and_a_refusal_says_how_to_avoid_them():
    """max_peak_bytes is judged against the peak with the copies; a refusal names them."""
    strided = _strided(W1)
    with use_backend("numba"):
        c_peak = bp.value_and_grad(loss).explain({"w1": W1, "w2": W2}, X).peak_bytes
        peak = bp.value_and_grad(loss).explain({"w1": strided, "w2": W2}, X).peak_bytes
        assert peak == c_peak + W1.nbytes
        fitted = bp.value_and_grad(loss, max_peak_bytes=peak)
        assert fitted.explain({"w1": strided, "w2": W2}, X).peak_bytes <= peak
        with pytest.raises(bp.MemoryBudgetError) as refused:
            bp.value_and_grad(loss, max_peak_bytes=c_peak).explain({"w1": strided, "w2": W2}, X)
    text = " ".join(str(refused.value).split())
    assert f"Up to {W1.nbytes} B of it are copies each call makes" in text
    assert "np.ascontiguousarray" in text


SLICED_3D = {  # a 3-D argument's views, each read in place as a slice of a span of its root
    "every other row": lambda a: np.repeat(a, 2, 1)[:, 1::2],
    "a block of a bigger array": lambda a: np.pad(a, ((1, 2), (0, 1), (1, 0)))[1:-2, :-1, 1:],
    "reversed and permuted": lambda a: np.ascontiguousarray(a.transpose(2, 0, 1)[::-1])[
        ::-1
    ].transpose(1, 2, 0),
    "broadcast, reversed, strided": lambda a: np.broadcast_to(
        np.repeat(a[:, :1, ::-1], 2, 2)[:, :, ::2], a.shape
    ),
}


@pytest.mark.parametrize("kind", sorted(SLICED_3D))
def test_a_sliced_3d_argument_is_read_in_place_with_its_gradient(kind):
    """Values and gradients of a 3-D sliced argument against the reference interpreter on the
    same array, the checked mode on, nothing copied."""
    rng = np.random.default_rng(11)
    x = SLICED_3D[kind](rng.standard_normal((3, 4, 5)).astype(np.float32))
    assert layout(x).startswith(SLICED), layout(x)
    _read_in_place_with_gradients(x, rng)


def test_a_slice_with_an_axis_of_one_element_is_read_whatever_stride_numpy_gave_it():
    """Every other column of a (3, 2) array is (3, 1) with strides (16, 16): NumPy keeps the
    parent's stride on the one-element axis, where the span's view has 8. Read in place
    (before: 'is not sliced [0:5:2, 0:1:1]' raised at the call), values equal NumPy's."""
    rng = np.random.default_rng(12)
    wide = np.zeros((3, 2))
    wide[:, ::2] = rng.standard_normal((3, 1))
    x, y = wide[:, ::2], rng.standard_normal((2, 3, 4))
    assert x.strides == (16, 16) and layout(x).startswith(SLICED), layout(x)
    with use_backend("numba"), checked_memory():
        got = bp.compile(lambda y, x: y - x)(y, x)
    np.testing.assert_array_equal(got.numpy(), y - x)
    x3 = SLICED_3D["every other row"](rng.standard_normal((3, 4, 1)).astype(np.float32))
    _read_in_place_with_gradients_1(x3, rng)


def _read_in_place_with_gradients_1(x: np.ndarray, rng) -> None:
    """x, a view with a one-element last axis, against the reference interpreter, its
    gradient included, the checked mode on."""
    s = rng.standard_normal(x.shape).astype(np.float32)

    def f(x, s):
        return bp.sum(bp.tanh(x * s))

    with use_backend("reference"):
        want = bp.value_and_grad(f)(x, s)
    with use_backend("numba"), checked_memory():
        value, gx = bp.compile(bp.value_and_grad(f))(x, s)
    np.testing.assert_allclose(float(value), float(want[0]), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(gx), np.asarray(want[1]), rtol=1e-5)


def test_a_view_reading_outside_its_input_is_refused_before_it_compiles():
    """ir/verify.py verify_input_views: a slice, transpose or broadcast chain over an input
    that reaches past its elements raises naming both; one inside passes. A reversed slice
    starting at the size (one element past the end) is refused by the op itself."""
    from backplan.ir.builder import make_value
    from backplan.ir.errors import ShapeError, VerifyError
    from backplan.ir.graph import Graph, Value
    from backplan.ir.types import TensorType
    from backplan.ir.verify import verify_input_views

    base = Value("input", (), {}, TensorType("f32", (4, 6)), None, "arg")
    inside = make_value("slice", [base], {"starts": (3, 1), "stops": (-1, 6), "steps": (-1, 2)})
    turned = make_value("transpose", [inside], {"perm": (1, 0)})
    verify_input_views(Graph("f", [base], [inside, turned], [turned], {}), [0])
    past = Value(
        "slice",
        [base],
        {"starts": (1, 0), "stops": (5, 6), "steps": (1, 1)},
        TensorType("f32", (4, 6)),
    )
    turned = make_value("transpose", [past], {"perm": (1, 0)})
    with pytest.raises(VerifyError, match=r"reads elements 6\.\.29 of .* which has 24"):
        verify_input_views(Graph("f", [base], [past, turned], [turned], {}), [0])
    with pytest.raises(ShapeError, match="out of range"):
        make_value("slice", [base], {"starts": (4, 0), "stops": (-1, 6), "steps": (-1, 1)})


def test_a_sliced_argument_on_a_dynamic_axis_is_copied_and_keeps_one_plan():
    """A sliced view's word names its sizes: on a dynamic axis it is keyed "strided" and
    copied (counted), and a new batch size finds the same symbolic plan."""
    wide = RNG.standard_normal((12, 16)).astype(np.float32)
    with use_backend("numba"), checked_memory():
        step = bp.compile(bp.value_and_grad(loss), dynamic={"x": {0: "b"}})
        for rows in (5, 7, 5, 9):
            x = wide[:rows, ::2]
            with use_backend("reference"):
                want = bp.value_and_grad(loss)({"w1": W1, "w2": W2}, x)
            _close(step({"w1": W1, "w2": W2}, x), want)
        report = step.explain({"w1": W1, "w2": W2}, wide[:9, ::2])
    assert report.call_peak.at_peak()["copies"] == 9 * 8 * 4  # x, copied
    assert step.cache_info().traces == 1


_SLICED_HWM = """
import numpy as np
import backplan as bp
def status(field):
    return [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(field)][0]
def f(w, v):
    return bp.sum(bp.tanh(w) * v)
wide = np.random.default_rng(0).standard_normal((1024, 2048)).astype(np.float32)
w, v = wide[:, 512:1536], np.ones(1024, np.float32)  # a 4 MiB column slice of 8 MiB
step = bp.compile(f)
want = float(np.sum(np.tanh(w.astype(np.float64)) * v))
for _ in range(2):
    step(w, v)
open("/proc/self/clear_refs", "w").write("5")
before = status("VmRSS")
got = float(step(w, v))
grown = status("VmHWM") - before
report = step.explain(w, v).call_peak
copies = report.at_peak().get("copies", 0)
print(abs(got - want) / abs(want), grown, report.allocated_peak_bytes, copies)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc")
def test_a_large_sliced_weight_adds_no_copy_to_the_resident_peak():
    """A fresh process, glibc returning freed blocks: a call reading a 4 MiB column slice of
    an 8 MiB array grows VmHWM by about what explain's call peak allocates (a copy per call
    grew it by the slice's 4 MiB, which explain counted as `copies`)."""
    env = dict(
        os.environ,
        MALLOC_MMAP_THRESHOLD_="0",
        MALLOC_TRIM_THRESHOLD_="0",
        BACKPLAN_BACKEND="numba",
    )
    out = subprocess.run(
        [sys.executable, "-c", _SLICED_HWM], env=env, capture_output=True, text=True, check=True
    )
    error, grown, allocated, copies = (float(n) for n in out.stdout.split()[-4:])
    assert error < 1e-3  # a float32 sum of 1M terms against float64
    assert copies == 0
    assert grown <= allocated + 512 * 1024, (grown, allocated)  # a few pages of the loop's own
    assert allocated < 64 * 1024


def test_inputs_count_what_the_caller_holds():
    """A broadcast argument is its compact array, a sliced one its span (the gaps between its
    elements too): report.peak's `inputs` counts those bytes, not the view's logical size."""
    wide = np.pad(X, ((0, 0), (2, 4)))  # (5, 14)
    with use_backend("numba"):
        step = bp.compile(bp.value_and_grad(loss))
        for x, held in (
            (np.broadcast_to(X[1], X.shape), X[1].nbytes),
            (wide[:, 2:10], wide.nbytes),
            (X, X.nbytes),
        ):
            step({"w1": W1, "w2": W2}, x)
            report = step.explain({"w1": W1, "w2": W2}, x)
            assert report.call_peak.input_bytes == W1.nbytes + W2.nbytes + held


def test_a_sliced_numpy_argument_saved_for_backward_is_counted_at_its_span():
    """x, a column slice the backward reads (x.T @ g): the fast path copies its span for the
    backward (read in place again), and every call's measured peak is explain's, the copy at
    the span's bytes."""
    wide = np.pad(X, ((0, 0), (2, 4)))  # (5, 14): x's span is all of it
    x = wide[:, 2:10]
    with use_backend("reference"):
        p = {"w1": bp.tensor(W1, requires_grad=True), "w2": bp.tensor(W2, requires_grad=True)}
        bp.compile(loss)(p, np.ascontiguousarray(x)).backward()
        want = p["w1"].grad.numpy()
    measured = []
    with use_backend("numba"), checked_memory():
        step = bp.compile(loss)
        p = {"w1": bp.tensor(W1, requires_grad=True), "w2": bp.tensor(W2, requires_grad=True)}
        for _ in range(4):
            with measure() as held:
                step(p, x).backward()
            measured.append(held.peak)
            np.testing.assert_allclose(p["w1"].grad.numpy(), want, rtol=1e-5, atol=1e-5)
            p["w1"].grad = p["w2"].grad = None
        report = step.explain(p, x)
    assert measured == [report.peak_on_call(n).allocated_peak_bytes for n in (1, 2, 3, 4)]
    tanh_out = X.shape[0] * W1.shape[1] * 4  # tanh(x @ w1), saved beside the copy of x
    two_plans = report.peak_on_call(1)  # calls 1-2; from call 3 a joint plan saves nothing
    assert two_plans.at_peak()["saved"] == wide.nbytes + tanh_out


def test_a_loaded_artifact_reads_arguments_in_their_layout(tmp_path):
    """bp.load's function, called with arrays in other layouts than the C-ordered ones it was
    exported with (tensors over a transposed, reversed or sliced array, a Fortran NumPy
    array): its plans are told the layouts (one program per layouts), so they read them in
    place or count their copies, and every call's measured peak is explain's (a copy the plan
    did not count made the checked mode raise)."""

    def f(w, x):
        return bp.sum(bp.tanh(x @ w) * w[0])

    path = bp.export(bp.compile(f), W1, X, path=str(tmp_path / "f.bpz"))
    loaded = bp.load(path)
    wide = np.pad(W1, ((0, 0), (3, 5)))
    with use_backend("reference"):
        want = float(f(W1, X))
    for w, copied in (
        (bp.from_dlpack(np.asfortranarray(W1)), 0),
        (bp.from_dlpack(np.ascontiguousarray(W1[::-1])[::-1]), 0),
        (bp.from_dlpack(wide)[:, 3:19], 0),
        (np.asfortranarray(W1), 0),
        (bp.from_dlpack(wide[:, 3:19]), W1.nbytes),  # its span unknown: copied, counted
    ):
        with use_backend("numba"), checked_memory():
            for _ in range(3):
                with measure() as measured:
                    got = float(loaded(w, X))
                np.testing.assert_allclose(got, want, rtol=1e-5)
            report = loaded.explain(w, X)
        assert measured.peak == report.call_peak.allocated_peak_bytes
        assert report.call_peak.at_peak().get("copies", 0) == copied


def test_a_loaded_value_and_grad_reads_arguments_in_their_layout(tmp_path):
    """The same for a loaded bp.value_and_grad: its joint plan told the layouts, values and
    gradients against the reference interpreter, measured == explain's peak."""
    step = bp.value_and_grad(loss)
    path = bp.export(step, {"w1": W1, "w2": W2}, X, path=str(tmp_path / "vg.bpz"))
    loaded = bp.load(path)
    wide = np.pad(W1, ((0, 0), (3, 5)))
    for w1, copied in (
        (bp.from_dlpack(np.asfortranarray(W1)), 0),
        (bp.from_dlpack(wide)[:, 3:19], 0),
        (bp.from_dlpack(wide[:, 3:19]), W1.nbytes),
    ):
        want = _reference(np.asarray(w1.numpy()), W2, X)
        with use_backend("numba"), checked_memory():
            for _ in range(3):
                with measure() as measured:
                    got = loaded({"w1": w1, "w2": W2}, X)
                _close(got, want)
            report = loaded.explain({"w1": w1, "w2": W2}, X)
        assert measured.peak == report.call_peak.allocated_peak_bytes
        assert report.call_peak.at_peak().get("copies", 0) == copied


def test_a_view_mostly_gaps_is_copied():
    """A column of a wide array (its span 16 times its elements) or every fourth column: no
    span to copy or count, so the view is copied per call (counted) as before."""
    assert layout(W1[:, :1]) == layout(W1[:, ::4]) == "strided"
    assert layout(W1[:, ::2]).startswith(SLICED)  # its span twice its elements


def test_the_fast_path_gives_a_strided_plan_only_what_it_would_copy_anyway():
    """A plan keyed "strided" copies its argument: the fast path hands it a sliced view too (a
    sliced view on a dynamic axis is keyed so), never an array another plan reads in place."""
    from backplan.tracer.fastpath import _same_layout

    sliced = np.repeat(W1, 2, axis=1)[:, ::2]
    assert _same_layout(_strided(W1), "strided", False)
    assert _same_layout(sliced, "strided", False)
    assert _same_layout(sliced, layout(sliced), False)
    for other in (np.asfortranarray(W1), W1[::-1], np.broadcast_to(W1[0], W1.shape), W1):
        assert not _same_layout(other, "strided", False)
