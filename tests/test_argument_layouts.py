"""Arguments in another layout than C order. An F-order one (a weight passed transposed, a
Fortran array) is read in place, as the transpose of its C-ordered .T (ir/in_place_inputs.py);
a reversed, broadcast or strided view is copied whole into C order on entry of each compiled
call (codegen/run/compiled.py), and explain's peak, the checked mode's prediction and the
signature all know it (ir/argument_layout.py, category "copies" in ir/peak.py). A misaligned
C-ordered array is read in place. Values and gradients against the reference interpreter on
the same arrays."""

from __future__ import annotations

import numpy as np
import pytest

import backplan as bp
from backplan.codegen.run.memory_check import checked_memory, measure
from backplan.ir.peak import joint_calls, predicted_peak, region_calls
from backplan.runtime.backend import use_backend

RNG = np.random.default_rng(3)
W1 = RNG.standard_normal((8, 16)).astype(np.float32)
W2 = RNG.standard_normal((4, 16)).astype(np.float32)
X = RNG.standard_normal((5, 8)).astype(np.float32)


def loss(p, x):
    return bp.sum(bp.tanh(x @ p["w1"]) @ p["w2"].T)


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
    "strided": (lambda: (np.repeat(W1, 2, axis=1)[:, ::2], W2, X), W1.nbytes, W1.nbytes),
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
        c_peak = c_step.explain(*c_args).call_peak.peak_bytes
    if layout in NO_COPY_AT_ALL or copied:
        assert report.call_peak.peak_bytes == c_peak + copied  # in place: the C-order peak
    else:
        assert c_peak < report.call_peak.peak_bytes < c_peak + whole  # an operand's copy
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
        s_args = ({"w1": np.repeat(W1, 2, axis=1)[:, ::2], "w2": W2}, X)
        for args in (r_args, c_args, s_args, r_args, f_args, s_args):
            step(*args)
        assert step.explain(*s_args).call_peak.at_peak()["copies"] == W1.nbytes
        for args in (c_args, f_args, r_args):
            assert "copies" not in step.explain(*args).call_peak.at_peak()
        strided_text = " ".join(str(step.explain(*s_args)).split())
        text = " ".join(str(step.explain(*f_args)).split())  # the text wraps
        reversed_text = " ".join(str(step.explain(*r_args)).split())
    assert "read in place, no copy: p['w1'] (F-order) in the forward call" in text
    assert "read in place, no copy: p['w1'] (reversed along axis 0)" in reversed_text
    assert "copy of p['w1'] (strided) 512 B in the forward call" in strided_text
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
    s = rng.standard_normal((3, 4, 5)).astype(np.float32)
    w = rng.standard_normal((5, 6)).astype(np.float32)

    def f(x, s, w):
        return bp.sum(bp.tanh(bp.tanh(x * s) @ w))

    with use_backend("reference"):
        want = bp.value_and_grad(f, argnums=(0, 2))(x, s, w)
    with use_backend("numba"), checked_memory():
        step = bp.compile(bp.value_and_grad(f, argnums=(0, 2)))
        for _ in range(3):
            value, (gx, gw) = step(permuted, s, w)
            np.testing.assert_allclose(float(value), float(want[0]), rtol=1e-5)
            np.testing.assert_allclose(np.asarray(gx), np.asarray(want[1][0]), rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(np.asarray(gw), np.asarray(want[1][1]), rtol=1e-4, atol=1e-5)
        report = step.explain(permuted, s, w)
    assert "copies" not in report.call_peak.at_peak()
    assert "read in place, no copy: x (" in " ".join(str(report).split())


def test_a_budget_counts_the_copies_and_a_refusal_says_how_to_avoid_them():
    """max_peak_bytes is judged against the peak with the copies; a refusal names them."""
    strided = np.repeat(W1, 2, axis=1)[:, ::2]
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
