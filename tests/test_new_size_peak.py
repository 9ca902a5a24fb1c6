"""At every size of a symbolic plan, explain's peak is what the compiled step holds: each of a
new size's calls, counted by the checked mode, equals the peak explain prints for that call,
both with the results let go before the next call and kept as a loop keeps them
(`value, grad = step(...)`: from call 2 the last call's results are held while it runs; that
peak is `report.peak`). Sizes on either side of a row run's CHUNKS rows (ir/row_local.py keeps
the first size's answer for every size), in both orders."""

import numpy as np
import pytest

import backplan as bp
from backplan.bench.memory_calls import counted_calls, printed_calls
from backplan.codegen.run.memory_check import checked_memory, measure
from backplan.ir.row_local import CHUNKS
from backplan.runtime.backend import use_backend

RNG = np.random.default_rng(29)
W = bp.tensor(RNG.standard_normal((6, 4)).astype(np.float32), requires_grad=True)
CALLS = 3


def bf16_softmax(w, x):
    h = bp.astype(bp.tanh(x @ w), bp.bfloat16)
    s = bp.astype(bp.softmax(h, axis=-1) * h, bp.float32)
    return bp.sum(s * bp.mean(x, axis=0)[:4])


def _held_in_a_loop(step, x) -> list[int]:
    """Each call's count with the previous call's results still bound, as a loop holds them."""
    counted, held = [], None
    with measure() as measured:
        for _ in range(CALLS):
            measured.restart_at_next_use()
            held = step(W, x)
            counted.append(measured.peak)
    del held
    return counted


@pytest.mark.parametrize("sizes", [(8, CHUNKS + 4, 12, CHUNKS + 1), (CHUNKS + 4, 8, 12)])
def test_each_new_size_holds_what_explain_prints_for_each_call(sizes):
    step = bp.value_and_grad(bp.compile(bf16_softmax, dynamic={"x": {0: "batch"}}))
    with use_backend("numba"), checked_memory():
        for n in sizes:
            x = bp.tensor(RNG.standard_normal((n, 6)).astype(np.float32))
            report = bp.explain(step, W, x)
            dropped = counted_calls(lambda x=x: step(W, x), CALLS)
            assert dropped == printed_calls(report, CALLS), n
            kept = _held_in_a_loop(step, x)
            assert kept == printed_calls(report, CALLS, loop=True), n
            # the loop's steady peak: the call's own buffers plus the results it still holds
            assert kept[-1] == report.peak.allocated_peak_bytes > dropped[-1], n
    assert step.cache_info().traces == 1
