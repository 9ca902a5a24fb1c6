"""What a call holds in the loop users write, `loss, grads = step(params, x)`: the names still
bind the previous call's results until the new call returns, so from call 2 those outputs are
alive beside everything the call allocates. explain's `peak_on_call` counts a call whose
caller dropped the last results first (as `step(params, x)` alone does); `loop_peak_on_call`
adds what the loop keeps, and the checked mode counts exactly that in such a loop. The peak
users see and budget against (report.peak_bytes, max_peak_bytes, memory_frontier, max_batch)
is that loop's: a budget met by one call alone was exceeded from the second.

Which outputs stay with the caller: a value_and_grad step returns its value and gradients; a
compiled function its outputs (a loss that backward() follows leaves its gradients in .grad,
which a loop clears with bp.zero_grad before the next call, and outputs written into donated
inputs go back in as the next call's donated arrays, counted there already).

>>> from backplan.ir.peak import PeakReport, PeakStep
>>> step = PeakStep(0, "joint", "matmul", "m.py:3", {"inputs": 8, "outputs": 4, "gradients": 8})
>>> holding(PeakReport("numba", (step,)), 12).peak_bytes
32
>>> later = PeakStep(1, "backward", "matmul", "m.py:4", {"inputs": 8, "gradients": 24})
>>> holding(PeakReport("numba", (step, later)), 4).peak_bytes  # backward() runs later
32
"""

from __future__ import annotations

from dataclasses import replace

from backplan.ir.peak import CATEGORIES, PeakReport
from backplan.ir.reference_storage import storage_roots

from .wording import format_bytes

KEPT = "previous outputs"  # the category the kept results are counted under
HELD_CATEGORIES = (*CATEGORIES, KEPT)  # every category a loop's peak step holds bytes under


def held_categories(peak: PeakReport) -> list[str]:
    """The categories any step of peak holds bytes under, in HELD_CATEGORIES order: a table or
    trace of these adds up to each step's total (the kept results included)."""
    return [c for c in HELD_CATEGORIES if any(s.held.get(c) for s in peak.steps)]


def kept_output_bytes(calls, gradients_returned: bool, not_returned=frozenset()) -> int:
    """Bytes of the results the plan calls of one step hand back that the step allocated and
    the loop does not pass back in: each output of a plan the call runs (backward()'s plan
    hands its gradients to .grad instead), its buffer counted once (a view lives in its
    base's), the caller's arrays and constants left out, and so are the outputs that go back
    in as the next call's donated arrays (a training step's new parameters and optimizer
    state: each output of a donated input's type, in order, as ir/donation.py pairs them).
    not_returned: outputs of the first plan the function drops (bp.grad's value). Results a
    loop passes back in without donation (`params = step(params, x)`, `x = f(x)`) are counted
    here too: which results a loop passes back is the loop's, not the function's, and is seen
    on a second call (tracer/loop_watch.py, report.observed_peak)."""
    kept, first = 0, True
    for call in calls:
        if call.idle or call.label == "backward":
            continue
        dropped, first = (not_returned if first else frozenset()), False
        graph = call.plan.graph
        roots, seen = storage_roots(graph), set()
        donated = [graph.inputs[i].type for i in call.plan.donated]
        returned = ("outputs", "gradients") if gradients_returned else ("outputs",)
        for i, (value, kind) in enumerate(zip(graph.outputs, call.output_kinds, strict=True)):
            if kind not in returned or i in dropped:
                continue
            if value.type in donated:
                donated.remove(value.type)  # passed back in: the next call's argument
                continue
            root = roots.get(value, value)
            if root in seen or root in graph.inputs or getattr(root, "op", None) == "const":
                continue
            seen.add(root)
            kept += root.type.nbytes
    return kept


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
    """'. The peak is that of the loop users write (loss, grads = step(params, x)), in which
    every call from the second also holds the previous call's 196,612 B (192.0 KiB) (its names
    keep them bound until the call returns); a call whose caller let them go holds 499,716 B
    (488.0 KiB) (report.call_peak_bytes)'; "" when a call hands back nothing it allocated. A
    loss that backward() follows holds the old one while its forward runs, not while
    backward()'s plan does."""
    kept = report.kept_output_bytes(1)
    if kept <= 0:
        return ""
    example, during = "out = f(params, x)", ""
    if report.returns_gradients:
        example = (
            "grads = step(params, x)" if report.not_returned else "loss, grads = step(params, x)"
        )
    elif "backward" in report.plans:
        example, during = "loss = f(params, x); loss.backward()", " while its forward runs"
    text = (
        f". The peak is that of the loop users write ({example}), in which every call from the "
        f"second also holds the previous call's {format_bytes(kept)}{during} (its names keep "
        f"them bound until the call returns); a call whose caller let them go holds "
        f"{format_bytes(report.call_peak_bytes)} (report.call_peak_bytes)"
    )
    if _may_pass_back(report):
        text += (
            ". Results your loop passes back in as the next arguments without donating them "
            "(params = step(params, x), x = f(x)) are the next call's arrays and count once, "
            "so that loop holds up to their bytes less"
        )
    return text + observed_sentence(report)


def _may_pass_back(report) -> bool:
    """Whether a result (not a gradient) has the type of an argument not donated: one a loop
    could pass back in. Results that go back in as the donated arguments (each output of a
    donated input's type, in order, as kept_output_bytes pairs them) are not: a training
    step whose new weights have the batch's type passes them back donated. Only the wording
    follows it; the figures count every result."""
    if not report.peak_calls:
        return False
    call = report.peak_calls[0]
    graph = call.plan.graph
    types = [v.type for i, v in enumerate(graph.inputs) if i not in call.plan.donated]
    donated = [graph.inputs[i].type for i in call.plan.donated]
    for value, kind in zip(graph.outputs, call.output_kinds, strict=True):
        if kind != "outputs":
            continue
        if value.type in donated:
            donated.remove(value.type)  # passed back in as the next call's donated argument
        elif value.type in types:
            return True
    return False


def observed_sentence(report) -> str:
    """What this process's loop did on the signature's second call, and the peak it held."""
    seen = report.loop_observed
    if seen is None:
        return ""
    return (
        f". Seen on this signature's second call, of the first call's results "
        f"{seen.words()}: this loop holds {format_bytes(report.observed_peak_bytes)} "
        "(report.observed_peak_bytes)"
    )
