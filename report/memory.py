"""The memory section of the explain() text: the reference interpreter's numbers (every IR value
its own buffer, the timeline the picture draws) and, under the numba backend, what each compiled
plan holds instead, so the reader always knows which path a number describes."""

from __future__ import annotations

from backplan.codegen.build import process_memory
from backplan.ir.lowering import lower

from .loop_peak import held_categories, loop_sentence
from .wording import format_bytes, peak_where, wrap


def peak_line(report) -> str:
    """'peak: 98,312 B (96.0 KiB) on the numba backend, at backward kernel 2 (...) at m.py:7:
    inputs ..., scratch ...': the one number a budget is checked against."""
    peak = report.peak
    if peak.peak_step is None:
        return "peak: 0 B (the step runs nothing)"
    text = (
        f"peak: {format_bytes(peak.peak_bytes)} on the {peak.backend} backend, at "
        f"{peak_step_words(peak)}"
    )
    text += f". {calls_sentence(report)}" if len(report.call_peaks) > 1 else ""
    return text + loop_sentence(report) + budget_sentence(report) + retain_sentence(report)


def budget_sentence(report) -> str:
    """Which figure the function's max_peak_bytes was judged against: this peak, every result
    counted as kept, and, where a second call showed what this loop holds, that figure too."""
    budget = report.max_peak_bytes
    if budget is None:
        return ""
    peak = report.peak_bytes
    text = (
        f". max_peak_bytes={budget:,} was judged against this peak, every result counted as "
        f"kept ({format_bytes(budget - peak)} to spare)"
    )
    observed = report.observed_peak_bytes
    if observed is not None and observed != peak:
        text += (
            f", not against the {format_bytes(observed)} this loop was seen to hold "
            "(report.observed_peak_bytes)"
        )
    return text


def retain_sentence(report) -> str:
    """What a call holds whose loss is backward()ed with retain_graph=True, then again
    (report.retain_peak), which the training loop above never does; "" without a backward."""
    retain = report.retain_peak
    if retain is None:
        return ""
    after = report.retain_after_joint_peak
    joint = ""
    if after is not None and after.peak_bytes != retain.peak_bytes:
        joint = f", {format_bytes(after.peak_bytes)} after the joint plan ran"
    kept = ""
    if retain.backend == "numba":
        kept = "; the first one's arena is held until the next call, which frees it"
    return (
        f". A loss backward()ed with retain_graph=True, then again, holds "
        f"{format_bytes(retain.peak_bytes)}{joint} (report.retain_peak): both backward plans "
        f"run, the first one's gradients held while the second runs{kept}"
    )


def calls_sentence(report) -> str:
    """'Calls 1-2 (the forward, then backward()'s plan): peak 3,324 B; from call 3 (one joint
    plan, ...): 3,448 B, the peak above': which plans run on which call (report.call_peaks)
    and the peak of each, the one above being the highest."""
    calls = report.call_peaks
    parts = []
    for c, after in zip(calls, [*calls[1:], None], strict=True):
        if after is None:
            which = f"from call {c.first_call}" if c.first_call > 1 else "every call"
        elif after.first_call - 1 == c.first_call:
            which = f"call {c.first_call}"
        else:
            which = f"calls {c.first_call}-{after.first_call - 1}"
        mark = ", the highest" if c.peak is report.call_peak else ""
        parts.append(f"{which} ({c.runs}): {format_bytes(c.peak.peak_bytes)}{mark}")
    text = "; ".join(parts)
    fallback = report.fallback_peak
    if fallback is not None:
        text += (
            f". A call back on two plans after that (a loss backward()ed from another seed, or "
            f"never backward()ed) holds up to "
            f"{format_bytes(fallback.peak_bytes)}, the joint plan's arena still held"
        )
    return text[0].upper() + text[1:]


def peak_step_words(peak) -> str:
    """'backward kernel 2 (loop: mul) at m.py:7: inputs 1,024 B, scratch ...': where a
    PeakReport peaks and what it holds there, by category."""
    step = peak.peak_step
    unit = "kernel" if peak.backend == "numba" else "step"
    where = f"{step.plan} {unit} {_step_in_plan(peak, step)} ({step.what})"
    if step.line:
        where += f" at {step.line}"
    parts = ", ".join(f"{c} {format_bytes(n)}" for c, n in peak.at_peak().items())
    return f"{where}: {parts}"


def _step_in_plan(peak, step) -> int:
    return sum(1 for s in peak.steps if s.plan == step.plan and s.index < step.index)


def timeline_table(report, max_rows: int = 14) -> str:
    """The one peak's accounting over the step: a row wherever what is held changes."""
    peak = report.peak
    categories = held_categories(peak)
    unit = "kernel" if peak.backend == "numba" else "step"
    rows = [(unit, "line", *categories, "total")]
    previous = None
    for step in peak.steps:
        if step.held == previous and step is not peak.peak_step:
            continue
        previous = step.held
        label = f"{step.plan} {_step_in_plan(peak, step)}" + (
            " (peak)" if step is peak.peak_step else ""
        )
        rows.append(
            (
                label,
                step.line,
                *(f"{step.held.get(c, 0):,}" for c in categories),
                f"{step.nbytes:,}",
            )
        )
    if len(rows) > max_rows + 1:
        rows = rows[: max_rows + 1] + [("...", "", *[""] * (len(categories) + 1))]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "    " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in rows
    )


def copies_note(report) -> str:
    """Which of the caller's arrays in another layout than C order each compiled call copies
    (ir/argument_layout.py), named with their layouts and bytes, and which it reads in place
    (ir/in_place_inputs.py); "" when every array is in C order."""
    if report.compiled is None:
        return ""
    names = [b.name for b in report.view.buffers.values() if b.kind == "input"]
    copied, read = [], []
    for call in report.peak_calls:
        if not call.copied:
            continue
        plan = lower(call.plan, call.private_saved).plan
        inputs = plan.graph.inputs
        first = call is report.peak_calls[0]
        for i, word in plan.copied:
            name = names[i] if first and i < len(names) else f"input {i}"
            size = format_bytes(inputs[i].type.nbytes)
            copied.append(f"copy of {name} ({word}) {size} in the {call.label} call")
        for i, word in plan.in_place:
            name = names[i] if first and i < len(names) else f"input {i}"
            read.append(f"{name} ({word}) in the {call.label} call")
    text = []
    if copied:
        text.append(
            "copies: the compiled kernels read their inputs in C order, so each call copies "
            "whole an array passed in another layout, on entry, and holds the copy until it "
            f"returns: {'; '.join(copied)}. np.ascontiguousarray once, outside the loop, saves "
            "a copy per call."
        )
    if read:
        text.append(
            "read in place, no copy: "
            + "; ".join(read)
            + " (the kernels read each as a view of the C-ordered array under it; one that needs"
            " an operand in C order copies it into the scratch arena, counted there)."
        )
    return " ".join(text)


def memory_text(report) -> str:
    parts = [
        wrap(peak_line(report)),
        timeline_table(report),
        wrap(copies_note(report)),
        wrap(reference_paragraph(report)),
    ]
    if report.compiled is None:
        parts.append(wrap(numba_hint()))
    else:
        parts.append(wrap(compiled_paragraph(report)))
        parts.append(compiled_table(report.compiled))
        parts.append(wrap(packing_note(report)))
        parts.append(wrap(process_note(report)))
        parts.append(wrap(donation_note(report)))
        parts.append(wrap(variants_note(report)))
    parts.append(frontier_text(report))
    return "\n".join(p for p in parts if p)


def frontier_text(report) -> str:
    """The plans max_peak_bytes chooses from, or why there is no choice."""
    frontier = report.frontier
    if frontier is None:
        return wrap(
            "Memory frontier: not known here (a loaded artifact holds its plans, not the "
            "planner that chooses them); explain the function where it is defined to see the "
            "plans max_peak_bytes chooses from."
        )
    if len(frontier.points) < 2:
        text = wrap(
            "Memory frontier: no plan that recomputes reaches a lower peak than "
            f"{format_bytes(frontier.points[0].peak_bytes)}, so max_peak_bytes below it is "
            "refused (bp.MemoryBudgetError says why)."
        )
    else:
        text = "\n".join("  " + line for line in str(frontier).splitlines())
    return text + _budgeted_calls_note(report) + _observed_loop_note(report)


def _observed_loop_note(report) -> str:
    """The frontier's peaks, like every budget, count every result as kept: where this loop
    was seen to hold less, say so, with both figures."""
    observed = report.observed_peak_bytes
    if observed is None or observed >= report.peak_bytes:
        return ""
    less = report.peak_bytes - observed
    return "\n" + wrap(
        f"These peaks, like max_peak_bytes, bp.max_batch and fits(), count every result as "
        f"kept until the next call returns; this loop was seen to hold "
        f"{format_bytes(observed)} (report.observed_peak_bytes), {format_bytes(less)} less "
        "than the peak line's: results it passed back in or let go."
    )


def _budgeted_calls_note(report) -> str:
    """A step whose calls run other plans without a budget (a joint step) runs the frontier's
    chosen plan on every call under one: say so, or its first row reads as a contradiction of
    the peak line."""
    if len(report.call_peaks) < 2:
        return ""
    later = report.call_peaks[-1]
    return "\n" + wrap(
        f"Under max_peak_bytes a row's plan runs on every call, never the joint plan that "
        f"runs from call {later.first_call} without a budget ({format_bytes(later.peak.peak_bytes)}"
        "): bp.max_batch answers for the budgeted step."
    )


def reference_paragraph(report) -> str:
    text = (
        "Reference interpreter (BACKPLAN_BACKEND=reference): every buffer NumPy allocates "
        "(a view shares the one it views), held from the step that writes it to the free "
        "after the last read of a value living in it"
    )
    if report.reference_peak_step is not None:
        text += (
            f"; the step peaks {peak_where(report)}, with "
            f"{format_bytes(report.reference_peak_bytes)}"
        )
    return text + (
        ". report.live_bytes and report.plot() follow this path; "
        "the arrays you pass in are yours and not counted there."
    )


def numba_hint() -> str:
    return (
        "The numba backend (the default; BACKPLAN_BACKEND=numba) compiles the plans "
        "instead: values inside a fused loop take no memory, other temporaries share a "
        "scratch arena kept across calls, and only what a call returns is allocated per "
        "call. explain() under it states those bytes for each plan."
    )


def compiled_paragraph(report) -> str:
    returned = (
        "the loss, aux outputs and gradients"
        if report.view.joint
        else "outputs, saved buffers, gradients"
    )
    text = (
        f"{report.backend.capitalize()} backend (what runs here), from the code generator's "
        "memory layout; nothing is compiled to find out. Values that stay inside a fused "
        "loop take no memory. Each compiled plan keeps a scratch arena, allocated once when "
        "it is compiled and reused by every call, for its other temporaries (those whose "
        f"lifetimes do not overlap share bytes); what a call returns ({returned}) is "
        "allocated fresh on every call."
    )
    if not report.view.joint:
        text += (
            " The forward and backward() draw their scratch from one arena of the larger's "
            "size (they never run at once in a step). A backward call holds its saved buffers "
            "and incoming gradients until it returns."
        )
    return text


def packing_note(report) -> str:
    """What backplan's GEMM keeps, in the peak: the pages its products write in the packing
    buffers each thread keeps for the process (report.packing_bytes), and how they depend on
    the threads; '' where no product runs on it."""
    packing = report.packing_bytes
    if not packing:
        return ""
    first, each, helpers = report.packing_threads
    threads = (
        f"on {helpers + 1} threads: {format_bytes(first)} the calling thread's + {helpers} x "
        f"{format_bytes(each)} its helper threads'"
        if helpers
        else "on one thread: no product is shared between threads"
    )
    return (
        f"The peak counts {format_bytes(packing)} of packing buffers (`packing`): the pages "
        f"backplan's GEMM writes packing these products' operands, in buffers each thread keeps "
        f"for the process's life, shared by every compiled function ({threads}; the figure "
        "follows the threads a product is shared between, numba.set_num_threads)."
    )


def process_note(report) -> str:
    """What the process holds once for compiled code, measured (report.process_bytes); shown
    once this step ran here, '' before: explain runs nothing, and a figure that depends on what
    else the process loaded before would change the text of a step that never ran."""
    held = report.process_bytes
    if not (report.ran_here and held):
        return ""
    loads, compiles = process_memory.counts()
    return (
        f"Beyond the peak too, this process holds {format_bytes(held)} for compiled code, "
        f"measured: its resident memory grew by that while backplan loaded {loads:,} kernel(s) "
        f"from the disk cache and Numba compiled {compiles:,} (LLVM's own code, the kernels' "
        "machine code, what compiling left resident; `report.process_bytes`). Once a process, "
        "shared by every compiled function, and not in the peak: a budget bounds the step."
    )


def compiled_table(facts) -> str:
    rows = [("plan", "kernels", "scratch arena (kept)", "fresh per call")]
    rows += [
        (f.plan, str(f.kernels), format_bytes(f.scratch_bytes), format_bytes(f.output_bytes))
        for f in facts
        if f.compiled
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        "    " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in rows
    ]
    lines += [
        f"    {f.plan.ljust(widths[0])}  runs on the reference interpreter: {f.unsupported}"
        for f in facts
        if not f.compiled
    ]
    return "\n".join(lines)


def donation_note(report) -> str:
    """Which outputs the forward writes into donated inputs (bp.compile(donate_argnums=...))."""
    forward = next((f for f in report.compiled if f.plan == "forward"), None)
    if forward is None or not forward.donated:
        return ""
    pairs = ", ".join(
        f"output {out} into {name} ({format_bytes(nbytes)})"
        for out, name, nbytes in forward.donated
    )
    total = sum(n for _, _, n in forward.donated)
    return (
        f"Donated inputs (donate_argnums): the forward writes these outputs into the buffers "
        f"of the donated inputs, so {format_bytes(total)} are not allocated per call: {pairs}. "
        "A donated tensor cannot be used after the call (bp.DonatedError)."
    )


def variants_note(report) -> str:
    by_plan = {f.plan: f for f in report.compiled}
    if "joint" in by_plan:
        return (
            "value_and_grad runs this one joint plan: the forward values its gradients read "
            "are temporaries of the call, in its scratch arena or fused away, and nothing is "
            "held afterwards."
        )
    consume = by_plan.get("backward (consume)")
    if consume is None:
        return ""
    reused = consume.reused_saved
    placed = f"here {reused} {'does' if reused == 1 else 'do'}" if reused else "here none does"
    return (
        "backward() runs backward (consume): the graph is freed anyway, so a temporary may "
        f"take over a saved buffer after its last read ({placed}). "
        "backward(retain_graph=True) runs backward (retain), which leaves the saved buffers "
        "intact."
    )
