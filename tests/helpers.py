"""Small shared helpers for tests."""

import functools
import inspect
import json
import os
import subprocess
import sys
import threading


def line_of(marker: str, path: str) -> int:
    """Line number of the first line in path containing marker (so tests need no magic numbers)."""
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            if marker in line:
                return number
    raise AssertionError(f"{marker!r} not in {path}")


def here(offset: int = 0) -> str:
    """file:line of the caller (plus offset lines), in backplan's location format."""
    frame = inspect.currentframe().f_back
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno + offset}"


def run_with_own_gemm_as_python(script: str, cache_dir) -> str:
    """stdout of script run in a fresh process whose kernels run as plain Python
    (BACKPLAN_KERNELS_AS_PYTHON=1) with backplan's own GEMM chosen for every matmul."""
    env = {
        **os.environ,
        "BACKPLAN_CACHE_DIR": str(cache_dir),
        "BACKPLAN_KERNELS_AS_PYTHON": "1",
        "BACKPLAN_GEMM": "own",
    }
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def run_in_threads(worker, keys) -> None:
    """worker(key) for every key, each in its own thread, started together; joins them all."""
    threads = [threading.Thread(target=worker, args=(key,)) for key in keys]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def script_facts(script: str, *args: str, env: dict, timeout: int = 600):
    """The JSON a script prints on its last line, run in a fresh interpreter with env."""
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, f"{args} exit {done.returncode}:\n{done.stderr}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def assert_16_bit_gemm_exact(gemm, ta, tb, a, b, bits, rng) -> None:
    """gemm(ta, tb, alpha, a, b, beta, c) of 16-bit whole-number operands, passed as views of
    `bits` (the integer type that tells the GEMM their format), equals the float32 product bit
    for bit: with beta 0 (C's NaNs never read) and with alpha 2, beta 1."""
    import numpy as np

    expected = (a.T if ta else a).astype(np.float32) @ (b.T if tb else b).astype(np.float32)
    c = np.full(expected.shape, np.nan, np.float32)
    gemm(ta, tb, 1.0, a.view(bits), b.view(bits), 0.0, c)
    np.testing.assert_array_equal(c.view(np.uint32), expected.view(np.uint32))
    c0 = rng.integers(-3, 4, expected.shape).astype(np.float32)
    c = c0.copy()
    gemm(ta, tb, 2.0, a.view(bits), b.view(bits), 1.0, c)
    np.testing.assert_array_equal(c, 2 * expected + c0)


# One 16-bit ulp of values in [1, 2): a float32 value that two correct computations leave one
# float32 ulp apart (another summation order, NumPy's tanh against backplan's) rounds to two
# different 16-bit values when it lies at a 16-bit rounding boundary, for about one value in
# 2**16 (bfloat16) or 2**13 (float16) per float32 ulp between them. Inherent to rounding.
SIXTEEN_BIT_ULP = {"bfloat16": 2.0**-7, "float16": 2.0**-10}


def assert_close_but_for_16_bit_roundings(got, want, dtype: str, rtol: float, atol: float):
    """got equals want to (rtol, atol) on at least 99% of the elements: a plan reading 16-bit
    saved copies read the copies the reference made. The others differ by one 16-bit rounding
    of a saved value the two computed one float32 ulp apart (SIXTEEN_BIT_ULP): at most one
    16-bit ulp of the largest |want|, the scale of one saved value's term in a gradient (a
    small element can move by more than its own 16-bit ulp through cancellation)."""
    import numpy as np

    got, want = np.asarray(got), np.asarray(want)
    close = np.isclose(got, want, rtol=rtol, atol=atol)
    assert close.mean() >= 0.99, f"{(~close).sum()} of {close.size} elements apart"
    scale = SIXTEEN_BIT_ULP[dtype] * float(np.abs(want).max())
    np.testing.assert_allclose(got, want, rtol=rtol, atol=max(atol, scale))


def tanh_chain(ws, x):
    """A small tanh MLP's loss: the plans memory tests plan, lower and free."""
    import backplan as bp

    h = x
    for w in ws:
        h = bp.tanh(h @ w)
    return h.sum()


def tanh_chain_weights():
    import numpy as np

    ws = [np.full((16, 16), 0.1, np.float32) for _ in range(4)]
    return ws, np.ones((32, 16), np.float32)


def counted_in_a_loop(call, calls: int = 4) -> list[int]:
    """The checked mode's count (codegen/run/memory_check.py: the step's own buffers, the
    arrays passed in apart) of each call of a loop whose names keep the last call's results
    bound until the next call returns, as `loss, grads = step(params, x)` does. Open it under
    checked_memory() for plans compiled there."""
    from backplan.codegen.run.memory_check import measure

    counted, results = [], None
    with measure() as measured:
        for _ in range(calls):
            measured.restart_at_next_use()
            results = call()  # the old results are freed once the call has returned
            counted.append(measured.peak)
    del results
    return counted


def result_arrays(results) -> list:
    """Every tensor of nested tuples (a value and its gradients, or several outputs), as arrays."""
    if isinstance(results, (tuple, list)):
        return [array for part in results for array in result_arrays(part)]
    return [results.numpy()]


def only_plan(compiled_fn, arguments):
    """The compiled plan of the one runner a call with these arguments has."""
    (runner,) = compiled_fn.trace(*arguments).runners()
    return runner.compiled


def tamper_signed_file(path) -> None:
    """Change one hex digit in the middle of a signed cache file, as a disk fault or an
    editor would: its signature no longer matches."""
    with open(path, "rb") as f:
        text = bytearray(f.read())
    middle = len(text) // 2
    text[middle] = ord("0") if text[middle] != ord("0") else ord("1")
    with open(path, "wb") as f:
        f.write(text)


def two_layer_step_source(w0_shape, w1_shape, rows, seed):
    """sum(tanh(relu(x @ w0) @ w1) ** 2)'s value and gradients (w0, w1) on the numba backend,
    checked against the reference interpreter's; returns the compiled driver's source, so a
    test can assert which GEMM each product ran."""
    import numpy as np

    import backplan as bp
    from backplan.runtime.backend import use_backend

    rng = np.random.default_rng(seed)
    w0 = bp.tensor(rng.standard_normal(w0_shape).astype(np.float32) * 0.1)
    w1 = bp.tensor(rng.standard_normal(w1_shape).astype(np.float32) * 0.1)
    x = bp.tensor(rng.standard_normal((rows, w0_shape[0])).astype(np.float32))

    def loss(w0, w1, x):
        return bp.sum(bp.tanh(bp.relu(x @ w0) @ w1) ** 2)

    vg = bp.value_and_grad(loss, argnums=(0, 1))
    with use_backend("numba"):
        value, grads = vg(w0, w1, x)
        source = vg.trace(w0, w1, x).runner().compiled.source
    with use_backend("reference"):
        want_value, want_grads = vg(w0, w1, x)
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-5)
    for got, want in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-5)
    return source


@functools.cache
def bench_symbolic_plan(name: str, dtype: str, small: bool = False):
    """The fitted symbolic plan (ir/symbolic.py) of a bench model's value_and_grad, dynamic on
    its batch axes, traced once on the reference backend (small: its small_config)."""
    import numpy as np

    import backplan as bp
    from backplan.bench.batch_sizes import loss_of
    from backplan.bench.models import MODELS
    from backplan.runtime.backend import use_backend
    from backplan.tracer.dynamic import DynamicEntry

    spec = MODELS[name]
    loss, axes = loss_of(spec)
    step = bp.value_and_grad(bp.compile(loss, dynamic=axes))
    cast = np.float32 if dtype == "float32" else bp.bfloat16
    data = spec.make_inputs(spec.small_config if small else spec.config, 0).cast(cast)
    args = [{k: bp.tensor(v) for k, v in data.params.items()}]
    with use_backend("reference"):
        step(*args, *(bp.tensor(b) for b in data.batch(True)))
    (entry,) = [e for e in step._entries.values() if isinstance(e, DynamicEntry)]
    assert entry.fitted is not None, entry.reason
    return entry.fitted


def written_module(module) -> tuple:
    """What a rendering (codegen/render/emit.GeneratedModule) writes: its source, lifted
    literals, loop kernels (source, digest, arguments) and counts."""
    kernels = [(k.digest, k.source, k.parallel, k.arguments) for k in module.loop_kernels]
    return (
        module.source,
        module.literals,
        kernels,
        module.constant_names,
        module.scratch,
        module.kernel_count,
        module.driver_statements,
    )


def step_of(kind: str, f, w, x):
    """One training step as users write it: clear w's gradient, call f, and for a compiled
    loss ("compile") call backward() on its result."""
    import backplan as bp

    def step():
        bp.zero_grad(w)
        result = f(w, x)
        if kind == "compile":
            result.backward()

    return step


def numpy_argument_layouts() -> dict:
    """One (48, 16) float32 argument in each memory layout a user's array comes in (C order,
    F order, a column slice, reversed rows): the layouts the kernels read in place."""
    import numpy as np

    rng = np.random.default_rng(3)
    wide = rng.standard_normal((48, 32)).astype(np.float32)
    return {
        "C order": rng.standard_normal((48, 16)).astype(np.float32),
        "F order": np.asfortranarray(rng.standard_normal((48, 16)).astype(np.float32)),
        "sliced": wide[:, ::2],
        "reversed": rng.standard_normal((48, 16)).astype(np.float32)[::-1],
    }
