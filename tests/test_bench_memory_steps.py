"""bench/memory.py's steps: what a fresh process's first step is compared with."""

import pytest

from backplan.bench import memory
from backplan.bench.internals import predicted_peak
from backplan.runtime.backend import use_backend


@pytest.mark.parametrize("kind", ["vg", "compile"])
def test_a_first_step_is_compared_with_the_whole_peak(kind):
    """The expected growth is the printed peak less the arrays passed in and the constants:
    the checked mode's figure, conv2d's im2col columns included (a buffer of the arena). A
    compile step's prediction covers its forward and the backward() after it."""
    with use_backend("numba"):
        step, args = memory._step("cnn", 1, kind)
        found = memory.first_step(step, args)
    predicted = predicted_peak(memory._calls(step, args), "numba")
    assert found["expected_growth"] == predicted.peak_bytes - predicted.input_bytes
    assert found["expected_growth"] == predicted.allocated_peak_bytes
    assert isinstance(found["gemm_packing_written"], int)
    if kind == "compile":
        plans = {s.plan for s in predicted.steps}
        assert plans == {"forward", "backward"}
        assert all(p.grad is not None for p in args[0].values())
