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
