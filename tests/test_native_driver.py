"""A compiled driver calls the library functions it uses through their native entry points,
not linked into its own module (codegen/build/native_calls.py), and keeps its loop kernels
inlined: its results equal the same driver with everything linked (the driver before) bit for
bit, and the Python-run driver's and the reference interpreter's to rounding; a driver loaded
from the disk cache in another process calls that process's addresses."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import backplan as bp
from backplan.bench.driver_compile import fresh_driver
from backplan.codegen.build import native_calls
from backplan.runtime.backend import use_backend

# the Numba-compiled driver and its calls of library functions by address
pytestmark = pytest.mark.usefixtures("compiled_driver")

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import backplan as bp
    from backplan.codegen.build import native_calls
    from backplan.runtime.backend import use_backend
    sys.path.insert(0, sys.argv[1])
    from native_driver_model import arguments, loss

    with use_backend("numba"):
        step = bp.value_and_grad(bp.compile(loss))
        value, grads = step(*arguments())
        plan = step.trace(*arguments()).runner().compiled
    run = plan._compiled_run
    print(json.dumps({
        "tier": plan.driver_tier,
        "hits": sum(run.stats.cache_hits.values()),
        "misses": sum(run.stats.cache_misses.values()),
        "published": native_calls.published_here(),
        "values": [float(value.item())] + [g.numpy().ravel().tolist() for g in grads],
    }))
    """
)

MODEL = textwrap.dedent(
    """
    import numpy as np
    import backplan as bp

    def loss(w, k, x):
        h = bp.relu(bp.conv2d(x, k))  # a library convolution, then a loop kernel
        return bp.mean(bp.tanh(h.reshape((x.shape[0], -1)) @ w) ** 2)  # a GEMM, loops

    def arguments():
        rng = np.random.default_rng(7)
        w = bp.tensor(rng.standard_normal((48, 5)).astype(np.float32))
        k = bp.tensor(rng.standard_normal((3, 1, 3, 3)).astype(np.float32))
        x = bp.tensor(rng.standard_normal((6, 1, 6, 6)).astype(np.float32))
        return w, k, x
    """
)


@pytest.fixture
def model(tmp_path, monkeypatch):
    """The model as a module a child process imports too, and a cache folder of its own."""
    (tmp_path / "native_driver_model.py").write_text(MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("BACKPLAN_CACHE_DIR", str(tmp_path / "kernels"))
    import native_driver_model

    yield native_driver_model
    sys.modules.pop("native_driver_model", None)


def _values(value, grads) -> list:
    return [value.numpy()] + [g.numpy() for g in grads]


def linked_driver(run):
    """The plan's driver compiled with every callee linked into it: the driver as it was."""
    linked = fresh_driver(run, linked=True)
    linked.compile(run.signatures[0])
    return linked


def test_the_compiled_driver_calls_library_functions_by_address_and_equals_the_linked_one(
    model, monkeypatch
):
    with use_backend("numba"):
        step = bp.value_and_grad(bp.compile(model.loss))
        compiled = _values(*step(*model.arguments()))
        plan = step.trace(*model.arguments()).runner().compiled
        assert plan.driver_tier == "compiled"
        called = native_calls.callees_of(plan._compiled_run)
        assert any("conv2d" in name for name in called), called  # a library function
        assert not any(name.startswith("backplan_kernel_") for name in called), called
        plan._run = linked_driver(plan._compiled_run)
        linked = _values(*step(*model.arguments()))
        assert native_calls.callees_of(plan._run) == []
        monkeypatch.setenv("BACKPLAN_DRIVER", "python")
        python_step = bp.value_and_grad(bp.compile(model.loss))
        python_run = _values(*python_step(*model.arguments()))
        assert python_step.trace(*model.arguments()).runner().compiled.driver_tier == "python"
    with use_backend("reference"):
        reference = _values(*bp.value_and_grad(model.loss)(*model.arguments()))
    for ours, before, python, expected in zip(compiled, linked, python_run, reference, strict=True):
        np.testing.assert_array_equal(ours, before)
        # The Python-run driver calls the kernels' loops compiled apart (kernel_source.py):
        # fastmath may contract a multiply-add in one form and not the other.
        np.testing.assert_allclose(ours, python, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(ours, expected, rtol=2e-5, atol=1e-6)


def _child(tmp_path) -> dict:
    done = subprocess.run(
        [sys.executable, str(tmp_path / "child.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        env={**os.environ, "BACKPLAN_DRIVER": "inline"},
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_cached_driver_in_a_new_process_calls_that_process_addresses(model, tmp_path):
    """Two processes in turn (this one may hold the plan's module from another test): the
    first compiles the driver into the cache, the second loads it."""
    (tmp_path / "child.py").write_text(SCRIPT)
    first, second = _child(tmp_path), _child(tmp_path)
    assert (first["tier"], first["misses"]) == ("compiled", 1)
    assert (second["tier"], second["hits"], second["misses"]) == ("compiled", 1, 0)
    # Every symbol the cached driver names was published with the second process's own
    # address of its callee (published_here compares them there), a library function's too.
    assert second["published"] and all(second["published"].values()), second["published"]
    assert any("conv2d" in callee for callee in second["published"])
    assert second["values"] == first["values"]


def test_a_cached_driver_naming_a_callee_this_process_lacks_is_compiled_again():
    """The hook refuses (cache_signing.StaleEntry: the cached driver reads as a miss) rather than
    load machine code whose call could not be resolved."""
    from backplan.codegen.build import cache_signing

    class Compiled:  # what symbol_name reads of a compiled function
        class fndesc:  # noqa: N801
            modname, qualname = "backplan_kernel_k_missing", "kernel"

        class signature:  # noqa: N801
            args = ()

    name = native_calls.symbol_name(Compiled)
    payload = b"object code ... " + name.encode() + b"\0 ..."
    assert native_calls.callees_in(payload) == ["backplan_kernel_k_missing.kernel"]
    with pytest.raises(cache_signing.StaleEntry, match="not loaded in this process"):
        native_calls.resolve_payload(payload)
