"""A compiled output that is a reshape of an output buffer is a view of the caller's buffer:
the driver returned only unit reshapes that way, so `reshape(tanh(x @ w), ...)` came back from
`run` as a writeable view, which the tensor wrapping it copied on every call (4 MB a call and
1.12x the CPU for a 2048x512 result), out of the checked mode's sight (a loop keeping the last
result counted 8 KiB less than explain prints). Views that are no reshape of the whole buffer
(a transpose, then reshaped) still come back from `run`, with the right values."""

from __future__ import annotations

import numpy as np
import pytest

import backplan as bp
from backplan.codegen.run.memory_check import checked_memory, measure
from backplan.runtime.backend import use_backend

CASES = {
    "reshape": lambda x, w: bp.reshape(bp.tanh(x @ w), (x.shape[1], -1)),
    "reshape twice": lambda x, w: bp.reshape(bp.reshape(bp.exp(x @ w), (-1,)), (1, -1)),
    "transpose then reshape": lambda x, w: bp.reshape(bp.tanh(x @ w).T, (-1,)),
    "reshape and its base": lambda x, w: (lambda t: (t, bp.reshape(t, (-1,))))(bp.tanh(x @ w)),
}


def arrays(rows=64, cols=32):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    x[0, 0], x[1, 1] = np.inf, np.nan
    return x, rng.standard_normal((cols, cols)).astype(np.float32)


@pytest.mark.parametrize("case", list(CASES))
def test_reshaped_outputs_equal_the_reference_and_are_the_callers_buffers(case):
    x, w = arrays()
    with use_backend("reference"):
        want = bp.compile(CASES[case])(x, w)
    fn = bp.compile(CASES[case])
    with use_backend("numba"), checked_memory():
        report = fn.explain(x, w)
        counted = []
        with measure() as held:
            got = None
            for _ in range(3):
                held.restart_at_next_use()
                got = fn(x, w)  # the last result kept while the next call runs
                counted.append(held.peak)
    for g, r in zip(*(o if isinstance(o, tuple) else (o,) for o in (got, want)), strict=True):
        np.testing.assert_allclose(g.numpy(), r.numpy(), rtol=2e-6, atol=1e-7)  # NaN, inf equal
    assert counted == [report.loop_peak_on_call(n).allocated_peak_bytes for n in (1, 2, 3)]
    with use_backend("numba"):
        got = bp.compile(CASES[case])(x, w)  # outside the checked mode, as a user calls it
    if case == "reshape and its base":  # one buffer, handed back twice
        assert np.shares_memory(got[0].numpy(), got[1].numpy())
    elif case != "transpose then reshape":
        assert not got.numpy().flags.owndata  # a view of the output buffer, not a copy
