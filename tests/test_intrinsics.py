"""backplan's intrinsics (codegen/kernels/intrinsics.py) look their typing cache up before Numba
refreshes the target context: a kernel's typing refreshes it as often for 40 loads as for 2,
and what they compute is unchanged."""

import numba
import numpy as np
from numba.core.registry import cpu_target

from backplan.codegen.kernels.views import load, origin, store


def sum_of_loads(count: int):
    """A function of `count` load calls: out[0] = x[0] + x[1] + ... + x[count - 1]."""
    terms = " + ".join(f"load(p, {i})" for i in range(count))
    source = (
        "def total(x_address, out_address):\n"
        "    p = origin(x_address, 0, np.float64)\n"
        "    q = origin(out_address, 0, np.float64)\n"
        f"    store(q, 0, {terms})\n"
    )
    scope = {"origin": origin, "load": load, "store": store, "np": np}
    exec(source, scope)
    return numba.njit(scope["total"])


def refreshes_while_compiling(function, monkeypatch) -> int:
    context = cpu_target.target_context
    calls = []
    refresh = type(context).refresh

    def counted(self):
        calls.append(1)
        return refresh(self)

    monkeypatch.setattr(type(context), "refresh", counted)
    function.compile((numba.types.voidptr, numba.types.voidptr))
    monkeypatch.undo()
    return len(calls)


def test_typing_refreshes_do_not_grow_with_the_number_of_calls(monkeypatch):
    refreshes_while_compiling(sum_of_loads(1), monkeypatch)  # the process's first typings
    few = refreshes_while_compiling(sum_of_loads(2), monkeypatch)
    many = refreshes_while_compiling(sum_of_loads(40), monkeypatch)
    assert many <= few + 2  # Numba's own refreshes per compile, not one per call


def test_the_loads_compute_what_numpy_does():
    x = np.random.default_rng(0).standard_normal(40)
    x[3] = np.inf
    out = np.zeros(1)
    total = numba.cfunc("void(voidptr, voidptr)")(sum_of_loads(40).py_func).ctypes
    total(x.ctypes.data, out.ctypes.data)
    assert out[0] == np.inf
    x[3] = 1.5
    total(x.ctypes.data, out.ctypes.data)
    np.testing.assert_allclose(out[0], x.sum(), rtol=1e-12)
