"""Loop kernels that cannot allocate compile without Numba's reference counting (cheaper to
compile) and take their arrays as addresses; anything that might allocate or hand back an
array keeps reference counting (else it would leak)."""

import numpy as np

import backplan as bp
from backplan.codegen.render.kernel_source import allocates
from backplan.runtime.backend import use_backend


def test_allocation_check_lists_what_is_allowed():
    assert not allocates(
        [
            "w0 = contiguous_view(a0, o0, (n0,))",
            "for i0 in range(n0):",
            "    t0 = tanh_f32(w0[i0]) + np.float32(1.0)",
            "    w0[i0] = math.exp(min(t0, np.float32(3.0)))",
        ]
    )
    assert allocates(["part = np.empty((n0,), np.float32)"])
    assert allocates(["work = gemm_workspace(512, mat_c)"])  # an array from a callee
    assert allocates(["t0 = w0.copy()"])  # any array method


def loss(w, b, x):
    return bp.sum(bp.tanh(x @ w + b) ** 2)


def compiled_loop_kernels(seed: int, shapes) -> list:
    """The loop kernels of loss's compiled gradient plan for random w, b, x of these shapes,
    once its value and gradients were checked against the reference interpreter."""
    rng = np.random.default_rng(seed)
    w, b, x = (bp.tensor(rng.standard_normal(shape).astype(np.float32)) for shape in shapes)
    with use_backend("numba"):
        vg = bp.value_and_grad(loss, argnums=(0, 1))
        value, grads = vg(w, b, x)
        kernels = vg.trace(w, b, x).runner().compiled.loop_kernels
    with use_backend("reference"):
        expected, expected_grads = bp.value_and_grad(loss, argnums=(0, 1))(w, b, x)
    np.testing.assert_allclose(value.numpy(), expected.numpy(), rtol=1e-5)
    for got, want in zip(grads, expected_grads, strict=True):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-6)
    return kernels


def test_lean_kernels_compute_what_the_reference_does():
    kernels = compiled_loop_kernels(1, ((7, 5), (5,), (3, 7)))
    decorators = {line for k in kernels for line in k.source.splitlines() if line.startswith("@")}
    assert "@njit(**ADDRESS_KERNEL_JIT_OPTIONS)" in decorators  # the elementwise loops
    assert "@njit(**KERNEL_JIT_OPTIONS)" not in decorators  # nothing here allocates


def test_address_loops_compile_no_wrapper_and_run_through_their_native_entry(monkeypatch):
    """A Python-run driver calls each address loop's native entry: no C wrapper is compiled
    (LLVM would inline the loop into it and emit it twice), and the results are the
    reference interpreter's."""
    monkeypatch.setenv("BACKPLAN_DRIVER", "python")  # never the compiled driver: the loops run
    from backplan.codegen.build import kernel_cache
    from backplan.codegen.flags import ADDRESS_KERNEL_JIT_OPTIONS

    assert ADDRESS_KERNEL_JIT_OPTIONS["no_cfunc_wrapper"]
    kernels = compiled_loop_kernels(2, ((6, 4), (4,), (5, 6)))
    calls = [kernel_cache.python_call(kernel_cache.kernel(k.digest)) for k in kernels]
    # each loop a call ran: its code library (its own, or one with the plan's other loops) and
    # its entry's name there; compiled here or loaded from the disk cache: symbols either way
    ran = [(c._libraries[s], c._symbols[s]) for c in calls for s in (0, 1) if c._libraries[s]]
    assert ran  # the first call ran the address loops
    for library, symbol in ran:
        assert library.get_pointer_to_function(symbol)
        assert not library.get_pointer_to_function(f"cfunc.{symbol}")  # Numba's wrapper name


def test_serial_kernels_take_the_short_pipeline_and_parallel_ones_numbas():
    """A generated serial loop compiles through backplan's short pipeline (no rewrite, closure
    or literal-unrolling passes); a parallel loop needs Numba's parfor passes and keeps them."""
    import numba

    from backplan.codegen import flags

    def double(x):
        for i in numba.prange(x.shape[0]):
            x[i] *= 2.0

    pipelines = {}
    for name in ("KERNEL", "LEAN_KERNEL", "ADDRESS_KERNEL", "SMALL_LOOP_KERNEL", "PARALLEL_KERNEL"):
        options = {**getattr(flags, f"{name}_JIT_OPTIONS"), "cache": False}
        if name == "PARALLEL_KERNEL":
            options["parallel"] = True
        kernel = numba.njit(**options)(double)
        x = np.arange(5.0)
        if name not in ("ADDRESS_KERNEL", "SMALL_LOOP_KERNEL"):  # these have no CPython wrapper
            kernel(x)
            np.testing.assert_array_equal(x, np.arange(5.0) * 2)
        (compiled,) = kernel.overloads.values() if kernel.overloads else [None]
        if compiled is None:
            kernel.compile((numba.float64[:],))
            (compiled,) = kernel.overloads.values()
        times = compiled.metadata["pipeline_times"]
        pipelines[name] = {pass_name for pipeline in times.values() for pass_name in pipeline}
    for name in ("KERNEL", "LEAN_KERNEL", "ADDRESS_KERNEL", "SMALL_LOOP_KERNEL"):
        assert not any("rewrite" in p or "unroll" in p for p in pipelines[name]), name
    assert any("parfor" in p for p in pipelines["PARALLEL_KERNEL"])
