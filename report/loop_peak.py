"""What a call holds in the loop users write, `loss, grads = step(params, x)`: the names still
bind the previous call's results until the new call returns, so from call 2 those outputs are
alive beside everything the call allocates. explain's `peak_on_call` counts a call whose
caller dropped the last results first (as `step(params, x)` alone does); `loop_peak_on_call`
adds what the loop keeps, and the checked mode counts exactly that in such a loop.

Which outputs stay with the caller: a value_and_grad step returns its value and gradients; a
compiled function its outputs (a loss that backward() follows leaves its gradients in .grad,
which a loop clears with bp.zero_grad before the next call, and outputs written into donated
inputs go back in as the next call's donated arrays, counted there already).

>>> from backplan.ir.peak import PeakReport, PeakStep
>>> step = PeakStep(0, "joint", "matmul", "m.py:3", {"inputs": 8, "outputs": 4, "gradients": 8})
>>> kept = kept_output_bytes(PeakReport("numba", (step,)), gradients_returned=True)
>>> kept, holding(PeakReport("numba", (step,)), kept).peak_bytes
(12, 32)
>>> later = PeakStep(1, "backward", "matmul", "m.py:4", {"inputs": 8, "gradients": 24})
>>> holding(PeakReport("numba", (step, later)), 4).peak_bytes  # backward() runs later
32
"""

from __future__ import annotations

from dataclasses import replace

from backplan.ir.peak import PeakReport

from .wording import format_bytes

KEPT = "previous outputs"  # the category the kept results are counted under


def kept_output_bytes(peak: PeakReport, gradients_returned: bool) -> int:
    """Bytes of the results a call of `peak` hands back that the step allocated: at its last
    kernel (or step) every output is still held, and nothing else of those categories."""
    if not peak.steps:
        return 0
    last = peak.steps[-1].held
    return last.get("outputs", 0) + (last.get("gradients", 0) if gradients_returned else 0)


def holding(peak: PeakReport, kept: int) -> PeakReport:
    """`peak` with `kept` bytes of the previous call's results held while the call runs: over
    every step of a plan the call itself runs, not over backward()'s plan, which runs after
    `loss = f(params, x)` has let the old loss go."""
    if not kept:
        return peak
    steps = tuple(
        s if s.plan == "backward" else replace(s, held={**s.held, KEPT: kept}) for s in peak.steps
    )
    return replace(peak, steps=steps)


def loop_sentence(report) -> str:
    """'. In a loop that keeps the last results until the call returns (loss, grads =
    step(params, x)), every call from the second also holds the previous call's 196,612 B
    (192.0 KiB): 696,328 B (680.0 KiB) (report.loop_peak_bytes)'; "" when a call hands back
    nothing it allocated. A loss that backward() follows holds the old one while its forward
    runs, not while backward()'s plan does."""
    kept = kept_output_bytes(report.peak_on_call(1), report.returns_gradients)
    if kept <= 0:
        return ""
    example, during = "out = f(params, x)", ""
    if report.returns_gradients:
        example = "loss, grads = step(params, x)"
    elif "backward" in report.plans:
        example, during = "loss = f(params, x); loss.backward()", " while its forward runs"
    return (
        f". In a loop that keeps the last results until the call returns ({example}), every "
        f"call from the second also holds the previous call's {format_bytes(kept)}{during}: "
        f"{format_bytes(report.loop_peak_bytes)} (report.loop_peak_bytes)"
    )
