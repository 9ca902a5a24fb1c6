"""bp.compile(donate_argnums=...): outputs written into donated input buffers, results equal to
the non-donated run, no new parameter memory per step, donated tensors unusable afterwards."""

import tracemalloc

import numpy as np
import pytest

import backplan as bp
from backplan.runtime.backend import use_backend
from tests.helpers import run_in_threads


def mlp_loss(params, x, y):
    h = bp.tanh(x @ params["w"] + params["b"])
    return ((h @ params["v"] - y) ** 2).mean()


OPT = bp.optim.chain(bp.optim.clip_by_global_norm(1.0), bp.optim.adam(0.01))


def train_step(params, state, x, y):
    loss, grads = bp.value_and_grad(mlp_loss)(params, x, y)
    params, state = OPT.update(grads, state, params)
    return params, state, loss


def problem(n=8, seed=0):
    rng = np.random.default_rng(seed)
    params = {
        "w": (rng.standard_normal((n, n)) / np.sqrt(n)).astype(np.float32),
        "b": np.zeros(n, np.float32),
        "v": rng.standard_normal((n, 2)).astype(np.float32),
    }
    x = rng.standard_normal((16, n)).astype(np.float32)
    y = rng.standard_normal((16, 2)).astype(np.float32)
    return params, x, y


def address(tensor) -> int:
    return tensor.numpy().__array_interface__["data"][0]


def leaves(tree):
    return bp.tracer.pytree.flatten(tree)[0]


def test_donated_step_reuses_every_buffer_and_equals_the_plain_step():
    params, x, y = problem()
    with use_backend("numba"):
        donated = bp.compile(train_step, donate_argnums=(0, 1))
        plain = bp.compile(train_step)
        p = {k: bp.tensor(v) for k, v in params.items()}
        q = {k: bp.tensor(v) for k, v in params.items()}
        s, r = OPT.init(p), OPT.init(q)
        for _ in range(3):
            before = [address(t) for t in leaves((p, s))]
            p, s, loss = donated(p, s, x, y)
            assert [address(t) for t in leaves((p, s))] == before
            q, r, expected = plain(q, r, x, y)
            np.testing.assert_allclose(loss.item(), expected.item(), rtol=1e-6)
            for a, b in zip(leaves((p, s)), leaves((q, r)), strict=True):
                # equal up to rounding: an in-place loop may vectorise differently (fastmath)
                np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-7)
        report = str(donated.explain(p, s, x, y))
    assert "Donated inputs (donate_argnums)" in report
    assert "output 0 into params['w']" in report
    assert "into state[1]['nu']['w']" in report


def step_peak_bytes(step, p, s, x, y) -> int:
    """Peak bytes traced by tracemalloc during one call (NumPy reports its buffers to it)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        start = tracemalloc.get_traced_memory()[0]
        step(p, s, x, y)
        return tracemalloc.get_traced_memory()[1] - start
    finally:
        tracemalloc.stop()


def test_donated_step_allocates_no_new_parameter_memory():
    params, x, y = problem(n=128)
    x, y = bp.tensor(x), bp.tensor(y)
    with use_backend("numba"):
        peaks = {}
        for donate in ((0, 1), ()):
            step = bp.compile(train_step, donate_argnums=donate)
            p = {k: bp.tensor(v) for k, v in params.items()}
            s = OPT.init(p)
            p, s, _ = step(p, s, x, y)  # compiles
            step.wait_until_compiled(timeout=300)  # its driver built, outside the measured call
            state_bytes = sum(t.nbytes for t in leaves((p, s)))
            peaks[donate] = step_peak_bytes(step, p, s, x, y)
    assert state_bytes > 190_000
    assert peaks[()] > state_bytes  # new params, moments and count every call
    # Only the loss and small objects: a driver run as Python (where no compiled one is
    # built) makes about 14 KB of array views; the smallest
    # state buffer that could be reallocated is w's 64 KB (and its two Adam moments).
    assert peaks[(0, 1)] < state_bytes / 8, peaks
    print(f"peak bytes per step: {peaks}, parameter and state bytes {state_bytes}")


def test_a_donated_tensor_still_named_does_not_keep_its_buffer_from_the_next_call():
    """`initial = params` kept for later, then `p, s, _ = step(p, s, x, y)`: the first call
    writes into the initial tensors' buffers, which those (now donated, unusable) tensors kept
    referencing, so the second call saw each buffer shared and allocated the parameters anew:
    a fresh copy every step while `initial` lived, beside explain's peak (the checked mode
    raised). A donated tensor lets go of its buffer once the call has it."""
    from backplan.codegen.run.memory_check import checked_memory

    params, x, y = problem()
    with use_backend("numba"), checked_memory():
        step = bp.compile(train_step, donate_argnums=(0, 1))
        initial = {k: bp.tensor(v) for k, v in params.items()}
        p, s = initial, OPT.init(initial)
        first = [address(t) for t in leaves((p, s))]
        for _ in range(3):
            p, s, _ = step(p, s, x, y)  # checked: raises where a buffer is not the predicted one
            assert [address(t) for t in leaves((p, s))] == first
    assert repr(initial["w"]).startswith("Tensor(<donated f32[8, 8] to train_step()")
    with pytest.raises(bp.DonatedError):
        initial["w"].numpy()


def test_using_a_donated_tensor_raises_and_names_the_call():
    params, x, y = problem()
    step = bp.compile(train_step, donate_argnums=(0, 1))  # the reference backend marks too
    p = {k: bp.tensor(v) for k, v in params.items()}
    s = OPT.init(p)
    old = p
    p, s, _ = step(p, s, x, y)
    message = r"donated to train_step\(\) \(bp.compile\(donate_argnums=\(0, 1\)\)\) at test_don"
    with pytest.raises(bp.DonatedError, match=message):
        old["w"].numpy()
    with pytest.raises(bp.DonatedError):
        old["w"] + 1.0
    with pytest.raises(bp.DonatedError):
        step(old, s, x, y)
    assert "donated" in repr(old["w"])
    np.testing.assert_array_equal(x, x)  # arguments not donated stay usable
    p, s, _ = step(p, s, x, y)


def test_unsafe_pairs_are_not_written_in_place():
    """A transposed read of the donated input in the loop that writes the output, and a
    read after the output is written, must keep separate buffers."""

    def mixed(a, m):
        return a.T * 2.0 + a, a @ m, a * 3.0

    rng = np.random.default_rng(1)
    a, m = rng.standard_normal((4, 4)).astype(np.float32), np.eye(4, dtype=np.float32)
    expected = [a.T * 2 + a, a @ m, a * 3]
    with use_backend("numba"):
        fn = bp.compile(mixed, donate_argnums=(0,))
        for _ in range(2):
            outs = fn(bp.tensor(a), m)
            for out, want in zip(outs, expected, strict=True):
                np.testing.assert_allclose(out.numpy(), want, rtol=1e-6)


def test_shared_buffers_are_not_overwritten():
    """A NumPy view of the donated tensor keeps its values: that buffer is not reused."""
    params, x, y = problem()
    with use_backend("numba"):
        step = bp.compile(train_step, donate_argnums=(0, 1))
        p = {k: bp.tensor(v) for k, v in params.items()}
        s = OPT.init(p)
        view = p["w"].numpy()
        kept = view.copy()
        p, s, _ = step(p, s, x, y)
        np.testing.assert_array_equal(view, kept)


def test_a_dlpack_import_is_not_donated_and_its_producer_keeps_its_values():
    """bp.from_dlpack shares the producer's memory; its tensor's array does not own it, so the
    call must not write into it, however few references the tensor's own array has."""
    src = np.arange(6.0)
    with use_backend("numba"):
        fn = bp.compile(lambda a: a * 2.0 + 1.0, donate_argnums=(0,))
        out = fn(bp.from_dlpack(src))
    np.testing.assert_array_equal(src, np.arange(6.0))
    np.testing.assert_array_equal(out.numpy(), np.arange(6.0) * 2 + 1)
    assert not np.shares_memory(out.numpy(), src)


def _two_outputs(a, b):
    return a + 1.0, b * 10.0


def test_donated_arguments_over_one_memory_are_not_written_in_place():
    """Two tensors over one array (or over overlapping parts of it) are one memory: donating
    both, or donating one while the other is read, would overwrite what the other reads."""
    whole = np.arange(5.0)
    with use_backend("numba"):
        both = bp.compile(_two_outputs, donate_argnums=(0, 1))
        first = bp.compile(_two_outputs, donate_argnums=(0,))
        cases = [
            (both, bp.from_dlpack(whole[:4]), bp.from_dlpack(whole[:4])),
            (first, bp.from_dlpack(whole[:4]), bp.from_dlpack(whole[1:])),
        ]
        for fn, a, b in cases:
            wanted = (a.numpy() + 1.0, b.numpy() * 10.0)
            for out, want in zip(fn(a, b), wanted, strict=True):
                np.testing.assert_array_equal(out.numpy(), want)
    np.testing.assert_array_equal(whole, np.arange(5.0))


def test_overlap_is_decided_by_byte_ranges():
    from backplan.tracer.donate import _overlapping

    base = np.zeros(20)
    arrays = [base[0:5], base[10:15], base[4:6], np.zeros(3), base[::7], base[16:]]
    assert _overlapping(arrays) == {0, 1, 2, 4}  # [::7] spans 0..14
    assert _overlapping([base[0:5], base[5:10]]) == set()


def test_grouping_by_owner_finds_every_overlap_the_byte_ranges_find():
    """The owner shortcut (arrays over different owning arrays never overlap) against comparing
    every byte range: views of one array, arrays owning their memory, zero-size arrays, and
    memory owned outside NumPy (a bytearray, a memory map's buffer) in one list."""
    from backplan.tracer.donate import _overlapping, _overlapping_ranges

    rng = np.random.default_rng(3)
    owners = [np.zeros(40), np.zeros((6, 7), np.float32), np.zeros(40)]
    foreign = np.frombuffer(bytearray(320), np.float64)  # its owner is a bytearray
    pieces = [
        lambda o: o,
        lambda o: o.reshape(-1)[3:9],
        lambda o: o.reshape(-1)[::5],
        lambda o: o.reshape(-1)[30:],
        lambda o: o.reshape(-1)[:0],
        lambda o: o.T if o.ndim == 2 else o[::-1],
    ]
    for _ in range(200):
        count = int(rng.integers(1, 7))
        arrays = [
            pieces[rng.integers(len(pieces))](owners[rng.integers(len(owners))])
            for _ in range(count)
        ]
        for _ in range(int(rng.integers(0, 3))):
            start = int(rng.integers(0, 30))
            arrays.insert(int(rng.integers(len(arrays) + 1)), foreign[start : start + 8])
        if rng.random() < 0.2:
            arrays.append(None)
        assert _overlapping(arrays) == _overlapping_ranges(arrays)


def test_a_donated_tensor_keeps_a_stand_in_holding_no_memory():
    from backplan.tracer.donate import stand_in

    for array in (np.ones((3, 4), np.float32), np.ones((), np.int64), np.ones((2, 0, 5))):
        kept = stand_in(array)
        assert (kept.shape, kept.dtype) == (array.shape, array.dtype)
        assert not kept.flags.writeable and not kept.any()
        assert all(stride == 0 for stride in kept.strides)
    half = stand_in(bp.tensor(np.ones((2, 3), np.float32)).astype(bp.bfloat16).numpy())
    assert half.shape == (2, 3) and half.dtype == np.dtype(bp.bfloat16)

    @bp.compile(donate_argnums=0)
    def step(w):
        return w * 2.0

    w = bp.tensor(np.ones((4, 4), np.float32))
    step(w)
    assert all(stride == 0 for stride in w._data.strides)
    with pytest.raises(bp.DonatedError):
        w + 1.0


def test_donating_an_argument_that_requires_grad_is_refused():
    @bp.compile(donate_argnums=0)
    def scale(w):
        return w * 2.0

    with pytest.raises(bp.TracingError, match="donated .* requires grad"):
        scale(bp.tensor([1.0, 2.0], requires_grad=True))
    with pytest.raises(ValueError, match="cannot be both static and donated"):
        bp.compile(lambda a: a, static_argnums=0, donate_argnums=0)


def test_donation_is_decided_by_the_pipeline_and_kept_in_the_lowered_plan():
    """The traced signature's donated inputs travel into the forward plan (plan.donated) and
    its lowering pairs them, before any runner exists: the reference backend never builds
    one, yet explain's facts and the compiled plan would read the same pairs."""

    def step(p, g):
        return p - 0.1 * g

    p, g = np.ones((3, 4), np.float32), np.ones((3, 4), np.float32)
    donated = bp.compile(step, donate_argnums=(0,)).trace(bp.tensor(p), g)
    plain = bp.compile(step).trace(bp.tensor(p), g)
    assert donated.program.plans.forward.donated == (0,)
    assert donated.program.plans.lowered().donations == {0: 0}
    assert plain.program.plans.forward.donated == ()
    assert plain.program.plans.lowered().donations == {}
    assert not donated.program.runners()  # decided without a runner


def test_one_tensor_donated_from_two_threads_at_once_runs_one_call():
    """Both calls check the tensor is live before either has run: the tensor must be given to
    one of them before it runs, and the other raise DonatedError (before, in some of the
    trials, both ran and wrote their results into its one buffer)."""
    import threading

    @bp.compile(donate_argnums=(0,))
    def step(w, x):
        return w - 0.1 * bp.tanh(x @ w), bp.sum(w)

    x = np.full((64, 64), 0.01, np.float32)
    for _ in range(3):
        step(bp.tensor(np.ones((64, 64), np.float32)), x)
    for _ in range(60):
        w = bp.tensor(np.ones((64, 64), np.float32))
        start, results = threading.Barrier(2), []

        def call(_, w=w, start=start, results=results):
            start.wait()
            try:
                results.append(step(w, x)[1].item())
            except bp.DonatedError:
                results.append("donated")

        run_in_threads(call, range(2))
        assert sorted(results, key=str) == [4096.0, "donated"]


def test_a_donating_call_that_raises_leaves_its_argument_usable():
    @bp.compile(donate_argnums=(0,))
    def step(w, labels):
        return w * 2.0, bp.take(w, labels)

    w = bp.tensor(np.ones(4, np.float32))
    with pytest.raises(bp.ExecutionError, match="index 9"):
        step(w, np.array([0, 9]))
    np.testing.assert_array_equal(w.numpy(), np.ones(4, np.float32))


def _one_value_twice(p, x):
    y = p["a"] * 0.5 + x
    return {"a": y, "b": y}  # p["b"] is never read


def test_one_value_returned_twice_and_donated_back_is_written_in_place():
    """The two tensors a step returns for one value hold one array; passed back donated, the
    one the plan reads is given up (the other is never read, and the call takes both), so
    the loop runs in one buffer as explain predicts: before, neither was donated, each call
    allocated its output, and the checked mode raised."""
    from backplan.codegen.run.memory_check import checked_memory

    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 64)).astype(np.float32)
    x = rng.standard_normal((64, 64)).astype(np.float32)
    with use_backend("numba"), checked_memory():
        step = bp.compile(_one_value_twice, donate_argnums=(0,))
        p = {"a": bp.tensor(a), "b": bp.tensor(np.zeros_like(a))}
        want, places = a, set()
        for _ in range(5):
            p = step(p, bp.tensor(x))  # the checked mode raises on an unpredicted allocation
            want = want * 0.5 + x
            places.add(p["a"].numpy().ctypes.data)
            np.testing.assert_allclose(p["a"].numpy(), want, rtol=1e-6)
            np.testing.assert_array_equal(p["b"].numpy(), p["a"].numpy())
    assert len(places) <= 2  # the first calls' fresh outputs, then one buffer


def test_tensors_over_one_array_that_the_step_reads_both_are_not_donated():
    """Both read: writing the result into their array would change what the other read."""
    with use_backend("numba"):
        step = bp.compile(lambda p: {"a": p["a"] + p["b"], "b": p["a"] * 2.0}, donate_argnums=(0,))
        shared = bp.tensor(np.arange(4.0, dtype=np.float32))
        out = step({"a": shared, "b": shared})
        np.testing.assert_array_equal(out["a"].numpy(), np.arange(4.0) * 2)
        np.testing.assert_array_equal(out["b"].numpy(), np.arange(4.0) * 2)


def _tensor_over(array):
    """A tensor holding this very array (bp.tensor would copy it)."""
    array.flags.writeable = False
    return bp.Tensor._from_array(array)


def test_the_owner_shortcut_gives_the_answer_of_the_memory_check():
    """donatable answers without comparing memory when each donated array is held by its tensor
    alone and owns its memory (or is the one view of an owner): over random arguments (views,
    shared arrays, one tensor passed twice, extra references, memory NumPy does not own) its
    answer, when it gives one, is the full check's."""
    from backplan.tracer.donate import _owning_arrays_held_once, donatable_by_memory

    rng = np.random.default_rng(7)
    answered = refused = 0
    for _ in range(400):
        tensors, held = [], []
        for _ in range(int(rng.integers(1, 6))):
            kind = rng.integers(7)
            owner = np.zeros(int(rng.integers(2, 12)), np.float32)
            if kind == 0 and tensors:  # one tensor passed again
                tensors.append(tensors[int(rng.integers(len(tensors)))])
            elif kind == 1:  # the one view of its owner (a 0-d output is one)
                tensors.append(_tensor_over(owner[: owner.size // 2]))
            elif kind == 2:  # a view whose owner the caller holds too
                held.append(owner)
                tensors.append(_tensor_over(owner[1:]))
            elif kind == 3 and tensors:  # over another argument's memory
                tensors.append(_tensor_over(tensors[-1]._data.reshape(-1)[:1]))
            elif kind == 4:  # memory NumPy does not own
                tensors.append(bp.from_dlpack(np.zeros(3, np.float32)))
            elif kind == 5:  # an owning array the caller holds too
                held.append(owner)
                tensors.append(_tensor_over(owner))
            else:
                tensors.append(_tensor_over(owner))
            del owner
        donated = tuple(sorted({int(i) for i in rng.integers(0, len(tensors), 3)}))
        quick = _owning_arrays_held_once(tensors, donated)
        if quick is None:
            refused += 1
        else:
            answered += 1
            assert quick == donatable_by_memory(tensors, donated)
    assert answered > 30 and refused > 30  # both ways are taken


def test_one_tensor_passed_twice_and_donated_is_not_written_in_place():
    """The same tensor in two places (both donated, or one donated and one read) is one memory:
    writing an output into it would change what the other place reads."""
    with use_backend("numba"):
        both = bp.compile(_two_outputs, donate_argnums=(0, 1))
        first = bp.compile(_two_outputs, donate_argnums=(0,))
        for fn in (both, first, both, first):
            a = bp.tensor(np.arange(4.0))
            outs = fn(a, a)
            np.testing.assert_array_equal(outs[0].numpy(), np.arange(4.0) + 1.0)
            np.testing.assert_array_equal(outs[1].numpy(), np.arange(4.0) * 10.0)
