"""A placement's C-order strides: each axis's stride is the product of the sizes after it,
zero-size and unit axes included (codegen/render/placement.py c_strides)."""

import math

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from backplan.codegen.render.placement import c_strides


@given(st.lists(st.integers(0, 9), max_size=6))
def test_c_strides_are_the_products_of_the_sizes_after_each_axis(shape):
    shape = tuple(shape)
    expected = tuple(math.prod(shape[k + 1 :]) for k in range(len(shape)))
    assert c_strides(shape) == expected
    if 0 not in shape:  # NumPy's own, in elements
        itemsize = np.dtype(np.float32).itemsize
        assert c_strides(shape) == tuple(s // itemsize for s in np.empty(shape, np.float32).strides)
