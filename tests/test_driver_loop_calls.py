"""BACKPLAN_DRIVER_LOOPS=address: a compiled driver calls the plan's loops through the native
entries its first calls ran (codegen/build/loop_calls.py) instead of inlining them. Its results
equal the Python-run driver's and the reference interpreter's (special values and odd shapes
included), none of the loops' view forms compiles, a cached driver loaded in a new process
resolves its loops to that process's entries, and a tampered cache file is rebuilt."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from helpers import only_plan, result_arrays, tamper_signed_file
from numba.types import Literal

import backplan as bp
from backplan.codegen.build import kernel_cache, loop_calls
from backplan.codegen.build.native_calls import callees_in
from backplan.runtime.backend import use_backend

MODEL = textwrap.dedent(
    """
    import numpy as np
    import backplan as bp

    def loss(w, k, x):
        h = bp.relu(bp.conv2d(x, k))  # a library convolution, then a loop kernel
        return bp.mean(bp.tanh(h.reshape((x.shape[0], -1)) @ w) ** 2)  # a GEMM, loops

    def special(x, y):
        # rows of inf, nan and -inf through exp, tanh, a max and a sum over odd sizes
        z = bp.exp(x) * bp.tanh(y) + bp.maximum(x, y)
        return bp.sum(z, axis=1), bp.max(z * 0.5 - y, axis=0)

    def arguments():
        rng = np.random.default_rng(7)
        w = bp.tensor(rng.standard_normal((45, 5)).astype(np.float32))
        k = bp.tensor(rng.standard_normal((3, 1, 3, 3)).astype(np.float32))
        x = bp.tensor(rng.standard_normal((5, 1, 7, 5)).astype(np.float32))  # odd sizes
        return w, k, x

    def special_arguments():
        rng = np.random.default_rng(3)
        x = rng.standard_normal((7, 13)).astype(np.float32)
        y = rng.standard_normal((7, 13)).astype(np.float32)
        x[1, :4] = [np.inf, -np.inf, np.nan, 90.0]  # exp overflows to inf at 90
        y[2, 3:6] = [np.nan, np.inf, -np.inf]
        return bp.tensor(x), bp.tensor(y)
    """
)

SCRIPT = textwrap.dedent(
    """
    import json, sys, warnings
    import numpy as np
    import backplan as bp
    from backplan.codegen.build import loop_calls
    from backplan.runtime.backend import use_backend
    sys.path.insert(0, sys.argv[1])
    from loop_calls_model import arguments, loss

    with warnings.catch_warnings(record=True) as caught, use_backend("numba"):
        warnings.simplefilter("always")
        step = bp.value_and_grad(bp.compile(loss))
        value, grads = step(*arguments())
        plan = step.trace(*arguments()).runner().compiled
    run = plan._compiled_run
    print(json.dumps({
        "tier": plan.driver_tier,
        "hits": sum(run.stats.cache_hits.values()),
        "misses": sum(run.stats.cache_misses.values()),
        "published": loop_calls.published_here(),
        "warnings": [str(w.message) for w in caught],
        "values": [float(value.item())] + [g.numpy().ravel().tolist() for g in grads],
    }))
    """
)


@pytest.fixture
def model(tmp_path, monkeypatch):
    """The model as a module a child process imports too, a cache folder of its own, and
    drivers compiled in the first call with their loops called by address."""
    (tmp_path / "loop_calls_model.py").write_text(MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("BACKPLAN_CACHE_DIR", str(tmp_path / "kernels"))
    monkeypatch.setenv("BACKPLAN_DRIVER_LOOPS", "address")
    monkeypatch.setenv("BACKPLAN_DRIVER", "inline")
    import loop_calls_model

    yield loop_calls_model
    sys.modules.pop("loop_calls_model", None)


def _three_ways(make, arguments, monkeypatch) -> tuple[list, list, list, object]:
    """(compiled driver calling loops by address, Python-run driver, reference interpreter)
    results of make(compile)(*arguments), and (the compiled plan, _view_forms_compiled before
    it)."""
    with use_backend("numba"):
        plan_before = _view_forms_compiled()
        compiled_fn = make(bp.compile)
        compiled = result_arrays(compiled_fn(*arguments))
        plan = only_plan(compiled_fn, arguments)
        monkeypatch.setenv("BACKPLAN_DRIVER", "python")
        python_fn = make(bp.compile)
        python_run = result_arrays(python_fn(*arguments))
        assert only_plan(python_fn, arguments).driver_tier == "python"
        monkeypatch.setenv("BACKPLAN_DRIVER", "inline")
    with use_backend("reference"):
        reference = result_arrays(make(lambda f: f)(*arguments))
    return compiled, python_run, reference, (plan, plan_before)


def _view_forms_compiled() -> dict:
    """Versions compiled so far of each loaded kernel's view form (what an inlining driver
    compiles): other tests in this process may have compiled some."""
    return {d: len(f.overloads) for d, f in kernel_cache._LOADED.items() if hasattr(f, "overloads")}


def _calls_loops_by_address(plan, before: dict) -> None:
    """The plan's driver is compiled, names loop symbols in its machine code, and none of its
    address kernels' view forms was compiled since `before` (_view_forms_compiled)."""
    assert plan.driver_tier == "compiled"
    (compiled,) = plan._compiled_run.overloads.values()
    code = b"".join(compiled.library.serialize_using_object_code()[2])
    by_address = [k for k in plan.loop_kernels if k.takes_addresses]
    assert (loop_calls.PREFIX.encode() in code) == bool(by_address)
    compiled_now = _view_forms_compiled()
    assert all(compiled_now[k.digest] == before.get(k.digest, 0) for k in by_address)
    others = {k.name for k in plan.loop_kernels if not k.takes_addresses}
    called = {name.split(".")[0].removeprefix("backplan_kernel_") for name in callees_in(code)}
    assert others <= called  # parallel kernels by address too, through native_calls


@pytest.mark.parametrize(
    "which", ["training step", "special values", "split driver", "parallel kernels"]
)
def test_the_driver_calling_loops_by_address_equals_the_python_run_driver_and_the_reference(
    model, monkeypatch, which
):
    if which == "parallel kernels":  # loops that take no addresses: prange over 91 elements
        from backplan.codegen import flags

        if flags.threads() < 2:
            pytest.skip("a parallel kernel needs two threads")
        monkeypatch.setattr(flags, "PARALLEL_MIN_ELEMENTS", 64)
    if which == "split driver":  # run calling run_part0, run_part1... (driver_split.py)
        from backplan.codegen.render import driver_split

        monkeypatch.setattr(driver_split, "SPLIT_ABOVE", 4)
        monkeypatch.setattr(driver_split, "PART_STATEMENTS", 3)
    if which in ("training step", "split driver"):
        make, arguments = lambda c: bp.value_and_grad(c(model.loss)), model.arguments()
    else:
        make, arguments = lambda c: c(model.special), model.special_arguments()
    compiled, python_run, reference, (plan, before) = _three_ways(make, arguments, monkeypatch)
    _calls_loops_by_address(plan, before)
    assert (len(plan._driver_parts) > 1) == (which == "split driver")
    assert len(compiled) == len(python_run) == len(reference) >= 2
    for ours, python, expected in zip(compiled, python_run, reference, strict=True):
        assert ours.shape == expected.shape and ours.dtype == expected.dtype
        # The same loop forms as the Python-run driver's, but a call may take the fully
        # optimised form where the Python-run one took the small one: rounding may differ.
        np.testing.assert_allclose(ours, python, rtol=1e-6, atol=1e-7)  # nan and inf alike
        np.testing.assert_allclose(ours, expected, rtol=2e-5, atol=1e-6)
    if which in ("special values", "parallel kernels"):
        assert np.isnan(compiled[0]).any() and np.isinf(compiled[1]).any()
    if which == "parallel kernels":
        # Called by address as the library is: compiled once for intp sizes, never again
        # for each literal size the driver passes (as a linked dispatcher would be).
        parallel = [kernel_cache.kernel(k.digest) for k in plan.loop_kernels if k.parallel]
        assert parallel
        for kernel in parallel:
            assert kernel.overloads
            assert not any(isinstance(t, Literal) for key in kernel.overloads for t in key)


def _child(tmp_path) -> dict:
    done = subprocess.run(
        [sys.executable, str(tmp_path / "child.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _is_loop_code(name: str) -> bool:
    return name.startswith("k_batch_") or (".kernel_at" in name and name.endswith(".nbc"))


def test_a_cached_driver_resolves_its_loops_in_a_new_process_and_tampered_files_are_rebuilt(
    model, tmp_path
):
    """Processes in turn: the first compiles the driver into the cache, the second loads it
    and publishes each loop symbol with its own entry's address; with the loops' batch object
    tampered, the third refuses it, compiles the loops again and still loads the driver; with
    the driver's own machine code tampered, the fourth compiles the driver again."""
    (tmp_path / "child.py").write_text(SCRIPT)
    first, second = _child(tmp_path), _child(tmp_path)
    assert (first["tier"], first["misses"]) == ("compiled", 1)
    assert (second["tier"], second["hits"], second["misses"]) == ("compiled", 1, 0)
    assert second["published"] and all(second["published"].values()), second["published"]
    assert second["values"] == first["values"]
    numba_files = tmp_path / "kernels" / "__pycache__"
    # The loops' machine code: a batch object, or Numba's file of each loop compiled alone.
    loops = [p for p in numba_files.iterdir() if _is_loop_code(p.name)]
    assert loops
    tampered = {}
    for path in loops:
        tamper_signed_file(path)
        tampered[path] = path.read_bytes()
    third = _child(tmp_path)
    assert (third["tier"], third["hits"], third["misses"]) == ("compiled", 1, 0)
    refused = [w for w in third["warnings"] if any(p.name in w for p in loops)]
    # one CacheWarning for the folder (each file a line of its own under BACKPLAN_VERBOSE=1)
    assert len(refused) == 1 and "failing the same check" in refused[0], third["warnings"]
    assert all(not p.exists() or p.read_bytes() != tampered[p] for p in loops)  # none kept
    assert all(third["published"].values()) and third["values"] == first["values"]
    drivers = [p for p in numba_files.iterdir() if p.name.startswith("bp_") and p.suffix == ".nbc"]
    assert drivers
    for path in drivers:
        tamper_signed_file(path)
    fourth = _child(tmp_path)
    assert (fourth["tier"], fourth["misses"]) == ("compiled", 1)
    assert fourth["values"] == first["values"]


def test_a_cached_driver_naming_a_loop_this_process_has_not_loaded_is_compiled_again():
    """The hook refuses (cache_signing.StaleEntry: the cached driver reads as a miss) rather
    than load machine code whose loop call could not be resolved."""
    from backplan.codegen.build import cache_signing

    payload = b"object code ... " + loop_calls.symbol("k_0123456789abcdef0123", True).encode()
    with pytest.raises(cache_signing.StaleEntry, match="k_0123456789abcdef0123 is not loaded"):
        loop_calls.resolve_payload(payload)


def test_a_bad_mode_is_refused_with_the_choices(monkeypatch):
    monkeypatch.setenv("BACKPLAN_DRIVER_LOOPS", "inlined")
    with pytest.raises(ValueError, match="BACKPLAN_DRIVER_LOOPS='inlined'; use one of linked"):
        loop_calls.mode()


def test_a_size_generic_driver_calling_loops_by_address_takes_each_size_values(model):
    """One driver for every batch size (its sizes read from lit_i, codegen/render/lift.py):
    the values of plans traced for each size alone."""
    w, k, x = model.arguments()
    step = bp.value_and_grad(bp.compile(model.loss, dynamic={"x": {0: "batch"}}))
    for n in (5, 3, 8):
        xs = bp.tensor(np.resize(x.numpy(), (n, *x.shape[1:])) * (1 + n / 10))
        before = _view_forms_compiled()
        with use_backend("numba"):
            got = result_arrays(step(w, k, xs))
            (runner,) = step.trace(w, k, xs).runners()
        assert "lit_i" in runner.compiled.source
        _calls_loops_by_address(runner.compiled, before)
        with use_backend("reference"):
            expected = result_arrays(bp.value_and_grad(model.loss)(w, k, xs))
        for ours, want in zip(got, expected, strict=True):
            np.testing.assert_allclose(ours, want, rtol=2e-5, atol=1e-6)
    assert step.cache_info().traces == 1
