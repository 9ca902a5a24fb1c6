"""views.transposed, how a generated driver writes a transposed view: compiled, it gives the
array and the Numba type that `array.transpose(axes)` gives, without Numba's run-time axis
check (whose error message compiled for ~3 CPU s in each process) and without its four small
allocations a call."""

import numpy as np
import pytest
from numba import njit, typeof

from backplan.codegen.kernels.views import as_read_only, transposed


@njit
def _ours(a):
    return transposed(a, 0, 2, 1), transposed(a, 2, 0, 1), transposed(as_read_only(a), 1, 0, 2)


@njit
def _numbas(a):
    return a.transpose(0, 2, 1), a.transpose(2, 0, 1), as_read_only(a).transpose(1, 0, 2)


@pytest.mark.numba
@pytest.mark.parametrize("strided", [False, True])
def test_compiled_transposes_equal_numpy_and_numba_in_values_and_types(strided):
    a = np.arange(2 * 6 * 4, dtype=np.float32).reshape(2, 6, 4)
    if strided:
        a = a[:, ::2, ::-1]  # negative and non-unit strides
    got, want = _ours(a), _numbas(a)
    for g, w, perm in zip(got, want, [(0, 2, 1), (2, 0, 1), (1, 0, 2)], strict=True):
        np.testing.assert_array_equal(g, a.transpose(perm))
        assert g.strides == w.strides and g.ctypes.data == a.ctypes.data  # a view, not a copy
    assert not got[2].flags.writeable and got[0].flags.writeable
    ours, numbas = (f.overloads[(typeof(a),)].signature.return_type for f in (_ours, _numbas))
    assert ours == numbas  # layout "A", read-only kept


def test_as_python_it_is_numpys_transpose():
    a = np.arange(24.0).reshape(2, 3, 4)
    np.testing.assert_array_equal(transposed(a, 1, 2, 0), a.transpose(1, 2, 0))
    assert transposed(a[0], 1, 0).base is not None


@pytest.mark.numba
def test_axes_that_are_not_a_permutation_are_refused_when_compiling():
    @njit
    def bad(a):
        return transposed(a, 0, 0, 1)

    with pytest.raises(Exception, match="transposed"):
        bad(np.zeros((2, 3, 4)))


@njit
def _as_drivers_write_them(a):
    return transposed(a, "0,2,1"), transposed(a, "2,0,1")


@pytest.mark.numba
def test_axes_as_one_string_compile_and_run_as_the_ints_do():
    """Drivers write the axes as one string: a size-generic driver turns every number of its
    text into a run-time read (render/lift.py), and compiled axes must be literals."""
    a = np.arange(2 * 6 * 4, dtype=np.float32).reshape(2, 6, 4)
    for g, perm in zip(_as_drivers_write_them(a), [(0, 2, 1), (2, 0, 1)], strict=True):
        np.testing.assert_array_equal(g, a.transpose(perm))
    np.testing.assert_array_equal(transposed(a, "1,2,0"), a.transpose(1, 2, 0))


@pytest.mark.numba
def test_a_dynamic_plan_with_a_transpose_compiles_its_driver(monkeypatch, tmp_path):
    """A column slice of the caller's arrays is read through transposed views. Before, the
    size-generic driver read their axes from its number array (`transposed(v16, lit_i[75],
    lit_i[76])`) and failed to compile: the plan stayed on the driver run as Python, with a
    DriverBuildWarning."""
    import backplan as bp
    from backplan.runtime.backend import use_backend
    from tests.test_argument_layouts import W1, W2, X, _wider, loss

    monkeypatch.setenv("BACKPLAN_DRIVER", "inline")  # a failed build raises in the call
    monkeypatch.setenv("BACKPLAN_CACHE_DIR", str(tmp_path))
    params = {"w1": _wider(W1, 3, 5), "w2": _wider(W2, 0, 7)}
    step = bp.compile(bp.value_and_grad(loss), dynamic={"x": {0: "rows"}})
    for rows in (X.shape[0], X.shape[0] - 1):
        x = _wider(X[:rows], 2, 0)
        value, grads = step(params, x)
        with use_backend("reference"):
            want, want_grads = bp.value_and_grad(loss)(params, x)
        np.testing.assert_allclose(np.asarray(value), np.asarray(want), rtol=1e-4)
        for name in want_grads:
            got = np.asarray(grads[name])
            np.testing.assert_allclose(got, np.asarray(want_grads[name]), rtol=1e-4, atol=1e-4)
