"""Loop kernels that allocate nothing take their arrays as addresses and have no CPython
wrapper: a compiled driver calls them through a caller that passes its arrays' addresses on,
a driver running as Python through their C entries (codegen/render/kernel_source.py,
codegen/build/kernel_cache.py). Both must compute what the reference interpreter does, on strided,
reversed, boolean, integer and empty views, and from two threads at once."""

import numpy as np
import pytest
from helpers import run_in_threads

import backplan as bp
from backplan.codegen.render.address_loops import loads_and_stores
from backplan.codegen.render.kernel_source import canonical_kernel
from backplan.codegen.run import address_calls
from backplan.runtime.backend import use_backend


def mixed(w, x, counts):
    """A transposed and a reversed view, a boolean mask, an int32 input cast to float, f32."""
    flipped = x[::-1, :]
    masked = bp.where(x > 0.0, bp.tanh(x * w), flipped * 0.5)
    scaled = masked * counts.astype(np.float32)
    return bp.sum(scaled * scaled) + bp.sum(bp.transpose(x) * 0.25)


def inputs(rng, rows):
    w = bp.tensor(rng.standard_normal((rows, 7)).astype(np.float32))
    x = bp.tensor(rng.standard_normal((rows, 7)).astype(np.float32))
    counts = bp.tensor(rng.integers(-3, 4, (rows, 7)).astype(np.int32))
    return w, x, counts


def expected(*args):
    with use_backend("reference"):
        return bp.value_and_grad(mixed, argnums=(0, 1))(*args)


def check(got, want):
    (value, grads), (want_value, want_grads) = got, want
    np.testing.assert_allclose(value.numpy(), want_value.numpy(), rtol=1e-5, atol=1e-6)
    for grad, want_grad in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(grad.numpy(), want_grad.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("driver", ["python", "inline"])
@pytest.mark.parametrize("rows", [5, 1, 0])
def test_address_kernels_compute_what_the_reference_does(driver, rows, monkeypatch):
    monkeypatch.setenv("BACKPLAN_DRIVER", driver)
    args = inputs(np.random.default_rng(rows), rows)
    step = bp.value_and_grad(bp.compile(mixed), argnums=(0, 1))
    with use_backend("numba"):
        got = step(*args)
        compiled = step.trace(*args).runner().compiled
    assert compiled.driver_tier == ("python" if driver == "python" else "compiled")
    sources = [k.source for k in compiled.loop_kernels]
    if rows > 1:  # an empty batch may leave nothing to loop over; one row has no strides
        assert any("def kernel_at(" in s for s in sources)
        assert any("load_bytes(" in s for s in sources)  # the reversed and transposed views
    check(got, expected(*args))


def test_two_threads_run_the_python_driver_at_once(monkeypatch):
    """Each driver call looks its arrays' addresses up in a table of its own thread."""
    monkeypatch.setenv("BACKPLAN_DRIVER", "python")
    step = bp.value_and_grad(bp.compile(mixed), argnums=(0, 1))
    cases = {key: inputs(np.random.default_rng(10 + key), 6) for key in range(2)}
    with use_backend("numba"):
        step(*cases[0])  # compiled once, before the threads
        failures = []

        def worker(key):
            try:
                for _ in range(50):
                    check(step(*cases[key]), wanted[key])
            except AssertionError as exc:
                failures.append(exc)

        wanted = {key: expected(*args) for key, args in cases.items()}
        run_in_threads(worker, [0, 1])
    assert failures == []


def test_a_kernel_takes_addresses_only_when_every_dtype_is_known():
    lines = ["w0 = contiguous_view(b0, o0, (n0,))", "for i0 in range(n0):", "    w0[i0] = 0"]
    scalars, bases = {"n0": 4, "o0": 0}, {"b0": "v1"}
    known = canonical_kernel(lines, scalars, bases, False, "", dtype_of=lambda b: "np.int32")
    unknown = canonical_kernel(lines, scalars, bases, False, "")
    assert "p0 = origin(a0, o0, np.int32)" in known.source and "store(p0, i0, 0)" in known.source
    assert "def kernel_at(" not in unknown.source and "def kernel(" in unknown.source
    assert known.digest != unknown.digest


def test_views_become_loads_and_stores_with_their_index_arithmetic():
    body = [
        "w0 = strided_view(a0, o0, (n0, n1,), (d0, d1,))",
        "w1 = contiguous_view(a1, o1, (n0, n1,))",
        "w2 = contiguous_view(a2, o2, (n1,))",
        "w2[:] = np.float64(0.0)",
        "for i0 in range(n0):",
        "    for i1 in range(n1):",
        "        t0 = w0[i0, i1] * w1[i0, 0]",
        "        w1[i0, i1] = t0",
        "        w2[i1] += t0",
    ]
    dtypes = {"a0": "np.float32", "a1": "np.float32", "a2": "np.float64"}
    assert loads_and_stores(body, dtypes) == [
        "p0 = origin(a0, o0, np.float32)",
        "p1 = origin(a1, o1, np.float32)",
        "p2 = origin(a2, o2, np.float64)",
        "for f_ in range(n1):",
        "    store(p2, f_, np.float64(0.0))",
        "for i0 in range(n0):",
        "    for i1 in range(n1):",
        "        t0 = load_bytes(p0, i0 * d0 + i1 * d1) * load(p1, (i0) * n1)",
        "        store(p1, (i0) * n1 + i1, t0)",
        "        store(p2, i1, load(p2, i1) + t0)",
    ]
    assert loads_and_stores([*body[:2], "t0 = w1.sum()"], dtypes) is None  # not an index
    assert loads_and_stores([*body[:1], "w0[:] = 0"], dtypes) is None  # a strided fill


def test_a_python_driver_keeps_each_looked_up_array_until_its_call_ends():
    """An array whose address a call looked up stays alive until the call returns, so no
    array made later in the same call can take its id (and be given its address)."""
    seen = []

    def run(scratch):
        for _ in range(3):
            view = scratch[1:].reshape(-1)  # a new object each time, dropped after use
            seen.append((id(view), address_calls.address(view)))
        return None

    scratch = np.zeros(16, np.float32)
    address_calls.with_addresses(run)(scratch)
    assert len({i for i, _ in seen}) == 3  # three live views: three ids
    assert {a for _, a in seen} == {scratch.ctypes.data + 4}
