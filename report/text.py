"""The explain() report as text: summary, plans, saved buffers, memory, kernels, retracing."""

from __future__ import annotations

from backplan.ir.text import value_names

from .memory import memory_text, peak_line
from .saved_table import format_saved_table, fused_note
from .wording import format_bytes, wrap


def render_report(report) -> str:

    sections = [
        (f"explain: {report.name}", ""),
        ("1. Summary", wrap(summary_text(report)) + "\n" + wrap(peak_line(report))),
        ("2. Plans", plans_text(report)),
        (saved_title(report), saved_text(report)),
        ("4. Memory", memory_text(report)),
        ("5. Kernels", wrap(kernels_text(report))),
        ("6. Retracing", wrap(retrace_text(report))),
    ]
    return "\n\n".join(f"{title}\n{body}".rstrip() for title, body in sections) + "\n"


def saved_title(report) -> str:
    title = f"3. Saved buffers ({len(report.saved_buffers)}, {format_bytes(report.saved_bytes)}"
    if report.recomputed:
        title += (
            f"; {len(report.recomputed)} recomputed instead, "
            f"{format_bytes(report.recomputed_bytes)} not saved"
        )
    if report.inner:
        n = inner_count(report)
        title += f"; {n} more inside value_and_grad, {format_bytes(report.inner_saved_bytes)}"
    return title + ")"


def inner_count(report) -> int:
    """Buffers held for the inlined value_and_grad plans' gradients: the step's own rows."""
    if report.inlined_saved is not None:
        return len(report.inlined_saved)
    return sum(len(r.saved_buffers) for _, r in report.inner)


def _step_held_text(report) -> str:
    calls = ", ".join(f"value_and_grad({j.name}) called at {j.loc}" for j, _ in report.inner)
    chosen = {j.chosen_for for j, _ in report.inner if j.chosen_for}
    budget = f" as {', '.join(sorted(chosen))} chose" if chosen else ""
    return wrap(
        f"inside {calls}: its forward and gradients are inlined into this step's plan, which "
        f"holds these values of that forward for the gradients and the update{budget}; they are "
        "temporaries of this step and its peak counts them (names and steps are this step's "
        "forward IR, section 2)"
    )


def saved_text(report) -> str:
    """The saved-buffer table, then one per value_and_grad plan inlined into this one."""
    parts = []
    if report.saved_buffers or report.recomputed or not report.inner:
        parts.append(format_saved_table(report.saved_buffers, recomputed=report.recomputed))
    if report.inner and report.inlined_saved is not None:
        parts += [_step_held_text(report), format_saved_table(report.inlined_saved)]
        parts.append(fused_note(report.fused_saved))
        return "\n".join(p for p in parts if p)
    parts.append(fused_note(report.fused_saved))
    for joint, inner in report.inner:
        made = (
            f"the joint plan's as {joint.chosen_for} makes it, the same values recomputed or "
            "narrowed as in this step"
            if joint.chosen_for
            else "the joint plan's, as value_and_grad(...).explain() prints it"
        )
        parts.append(
            wrap(
                f"inside value_and_grad({joint.name}) called at {joint.loc}: its joint plan, "
                "inlined into this step, keeps these for its backward part; they are "
                f"temporaries of this step and its peak counts them (names and steps are {made})"
            )
        )
        parts.append(format_saved_table(inner.saved_buffers, recomputed=inner.recomputed))
        parts.append(fused_note(inner.fused_saved))
    return "\n".join(p for p in parts if p)


def summary_text(report) -> str:
    fused = report.fused_kernels
    fusion = f"{fused} of them fused" if fused else "none fused"
    if report.backend == "reference" and not fused:
        fusion = "the reference interpreter runs each IR node on its own"
    parts = [
        f"{report.name} has {report.n_forward_steps} forward and "
        f"{report.n_backward_steps} backward steps, run as {_kernels(report.n_kernels)} on the "
        f"{report.backend} backend ({fusion})."
    ]
    parts.append(_saved_sentence(report))
    parts.append(_recomputed_sentence(report))
    parts.append(report.saved_dtype_note)
    parts.append(_update_order_sentence(report.update_order, report.kept_output_bytes(1)))
    parts.append(_peak_sentence(report))
    parts.append(_compiled_sentence(report))
    parts.append(_freeing_sentence(report))
    return " ".join(p for p in parts if p)


def _saved_sentence(report) -> str:
    if report.inner and not any(report.requires_grad):
        return _inner_sentence(report)
    if not any(report.requires_grad):
        return (
            "Nothing needs a gradient (no input requires grad, or grad mode is off), so "
            "there is no backward and nothing is saved."
        )
    n = len(report.saved_buffers)
    if n == 0:
        return "The backward needs no forward values: nothing is saved."
    text = (
        f"The forward keeps {n} saved buffer{'s' if n != 1 else ''} for the backward, "
        f"{format_bytes(report.saved_bytes)} in total"
    )
    copies = sum(b.nbytes for b in report.saved_buffers if getattr(b, "copy_of_argument", 0))
    held = []
    if report.saved_input_bytes:
        held.append(
            f"{format_bytes(report.saved_input_bytes)} of them your own inputs, held by "
            "reference, not copied"
        )
    if copies:
        held.append(
            f"{format_bytes(copies)} of them copies of the NumPy arrays you pass, taken at the call"
        )
    if held:
        text += f" ({'; '.join(held)})"
    return text + "." + _fused_words(report.fused_saved)


def _fused_words(fused) -> str:
    """Where the compiled plan keeps fewer values than the unfused plan reads across."""
    if not fused:
        return ""
    n = len(fused)
    return (
        f" That is the compiled plan's count: {n} more value{'s' if n != 1 else ''} the "
        f"gradients read ({format_bytes(sum(f.nbytes for f in fused))}) "
        f"{'are' if n != 1 else 'is'} computed inside the fused loop that reads "
        f"{'them' if n != 1 else 'it'}, never stored (section 3)."
    )


def _inner_sentence(report) -> str:
    """A training step: no backward of its own, but the value_and_grad inside it saves."""
    n = inner_count(report)
    calls = ", ".join(f"value_and_grad({j.name}) at {j.loc}" for j, _ in report.inner)
    text = (
        f"No input of the step needs a gradient, so it has no backward of its own; {calls} "
        f"runs inside it, its forward and backward inlined, and keeps {n} saved "
        f"buffer{'s' if n != 1 else ''} for that backward, "
        f"{format_bytes(report.inner_saved_bytes - report.inner_saved_input_bytes)} allocated "
        "by the step"
    )
    if report.inner_saved_input_bytes:
        text += (
            f" and {format_bytes(report.inner_saved_input_bytes)} of your own arrays read "
            "by reference"
        )
    return text + " (section 3)." + _fused_words(report.all_fused_saved)


def _update_order_sentence(order, kept: int = 0) -> str:
    """A training step: whether its optimizer updates run right after their gradients. The
    peaks are the loop's, as the peak line's: kept, the last results a loop holds beside each
    call (ir/update_order.py weighs one call; the same bytes are kept in either order)."""
    if order is None:
        return ""
    traced, early = format_bytes(order.traced + kept), format_bytes(order.early + kept)
    if order.kept:
        return (
            "Each optimizer update runs right after the last read of the gradient it needs and "
            "of the old value it overwrites, so that gradient's buffer is freed at once: peak "
            f"{early} on the {order.backend} backend, against {traced} with every update after "
            "every gradient as traced (BACKPLAN_EARLY_UPDATES=0)."
        )
    return (
        "The optimizer updates run after every gradient, as traced: run right after their "
        f"gradients they would hold {early} at the peak on the {order.backend} backend, "
        f"against {traced}."
    )


def _recomputed_sentence(report) -> str:
    n = len(report.recomputed)
    if not n:
        return ""
    return (
        f"Rematerialisation recomputes {n} value{'s' if n != 1 else ''} in the backward "
        f"instead of saving {'them' if n != 1 else 'it'}, so "
        f"{format_bytes(report.recomputed_bytes)} are not saved "
        "(bp.compile(remat=False) saves everything)."
    )


def _compiled_sentence(report) -> str:
    if report.compiled is None:
        return ""
    text = (
        f"Compiled for the {report.backend} backend, the step keeps "
        f"{format_bytes(report.compiled_scratch_bytes)} of scratch arenas across calls and "
        f"allocates {format_bytes(report.compiled_output_bytes)} fresh per call"
    )
    reused = report.compiled_reused_output_bytes
    if reused:
        text += (
            f", and keeps one generation of its large outputs, {format_bytes(reused)}, between "
            "calls to write the next call's into (a loop that rebinds its results faults in no "
            "new pages): the loop users write holds "
            f"{format_bytes(report.loop_resident_bytes)} between calls, arenas and results "
            "included (report.loop_resident_bytes)"
        )
    refused = refused_plans(report)
    if refused:
        text += f"; the {refused} runs on the reference interpreter instead"
    if report.background_build:
        building = report.building_peak
        text += (
            "; with background=True its calls run on the reference interpreter until the "
            f"kernels are built, holding up to {format_bytes(building.peak_bytes)} meanwhile "
            "(report.building_peak: the interpreter's buffers plus the plans' scratch arenas), "
            "not the compiled peak"
        )
    joint = report.joint_step_facts
    if joint is not None and joint.compiled:
        text += (
            f"; from call {report.call_peaks[-1].first_call} its joint plan keeps "
            f"{format_bytes(joint.scratch_bytes)} and allocates "
            f"{format_bytes(joint.output_bytes)} per call instead (the two plans free "
            "their arenas)"
        )
    return text + " (section 4)."


def refused_plans(report) -> str:
    """'forward plan', 'backward plan' or 'forward and backward plans': what numba cannot
    compile; '' when it compiles everything."""
    names = list(
        dict.fromkeys(f.plan.split(" ")[0] for f in report.compiled or () if not f.compiled)
    )
    if not names:
        return ""
    return f"{' and '.join(names)} plan{'s' if len(names) > 1 else ''}"


def _peak_sentence(report) -> str:
    peak = report.peak
    if peak.peak_step is None:
        return ""
    return (
        f"Predicted peak on the {peak.backend} backend: {format_bytes(peak.peak_bytes)}, "
        f"the {format_bytes(peak.input_bytes)} of arrays you pass in included (section 4 "
        "splits it by category; report.fits(bytes) checks a budget)."
    )


def _freeing_sentence(report) -> str:
    if not any(report.requires_grad):
        return ""
    if report.view.joint:
        return (
            "value_and_grad runs forward and backward as one plan: saved buffers live only "
            "inside the call, each freed after its last read; nothing is held afterwards, "
            "so there is no graph to free or retain."
        )
    return (
        "Each call builds a new graph that holds its own saved buffers until backward(), "
        "which frees each right after its last read (the lifetime column); graphs built "
        "later on its outputs share it, so the first backward() through any of them frees "
        "it. A second backward() through a freed graph always raises GraphFreedError, "
        "saved buffers or not, unless the first passed retain_graph=True. "
        "print(out.grad_fn) shows which buffers are freed."
    )


def plans_text(report) -> str:
    lines = []
    for name, plan in report.plans.items():
        title = {
            "forward": "forward IR",
            "backward": "backward IR",
            "joint": "joint IR (forward steps fN, then backward steps bN, in one plan)",
        }[name]
        lines.append(f"  {title}")
        lines.extend(f"    {legend}" for legend in _input_legend(report, name, plan))
        if name == "backward" and report.recomputed:
            names = value_names(plan.graph)
            lines.append(
                "    recomputed here instead of saved (forward name -> its name here): "
                + ", ".join(_recomputed_text(r, plan, names) for r in report.recomputed)
            )
        lines.extend(_gutter(plan.text(), _labels(report, name)))
        lines.append("")
    return "\n".join(lines).rstrip()


def _recomputed_text(r, backward_plan, names: dict) -> str:
    if r.recomputed_step is None:
        return f"{r.name} (the step that rebuilds it was not found)"
    node = backward_plan.graph.nodes[r.recomputed_step]
    return f"{r.name} -> {names[node]} at b{r.recomputed_step}"


def _labels(report, plan_name: str) -> list[str]:
    if plan_name == "joint":
        return [s.label for s in report.view.steps]
    return [s.label for s in report.view.steps if s.phase == plan_name]


def _gutter(text: str, labels: list[str]) -> list[str]:
    """The plan text unchanged, each op line prefixed with its step label."""
    labels_left = iter(labels)
    out = []
    for line in text.splitlines():
        label = next(labels_left, "?") if line.startswith("  %") else ""
        out.append(f"  {label:>5} {line}")
    return out


def _input_legend(report, plan_name: str, plan) -> list[str]:
    inputs = plan.graph.inputs
    if plan_name != "backward":
        return [
            f"%{i} = {report.view.buffers[f'f%{i}'].name}: {v.type}"
            + (
                ", requires grad"
                if i < len(report.requires_grad) and report.requires_grad[i]
                else ""
            )
            for i, v in enumerate(inputs)
        ]
    n_cot = sum(1 for v in inputs if v.role == "cotangent")
    legend = []
    for i, value in enumerate(inputs):
        if value.role == "cotangent":
            legend.append(
                f"%{i} = {report.view.buffers[f'b%{i}'].name}: the gradient flowing "
                "into that forward output"
            )
        else:
            legend.append(f"%{i} = saved {report.saved_buffers[i - n_cot].name}")
    return legend


def _kernels(n: int) -> str:
    return f"{n} kernel{'s' if n != 1 else ''}"


def kernels_text(report) -> str:
    """The kernels the plans run, then where 16-bit results are rounded, then (for a
    compiled loss) when a call runs as one plan."""
    text = _kernels_text(report)
    if report.kept_float32:
        steps = report.view.steps
        kept = ", ".join(f"{steps[s].label} {steps[s].op}" for s in report.kept_float32)
        text += (
            f"\n16-bit values kept in float32 by the fused loop computing them, for the ops "
            f"after it there (rounded only where a buffer stores them): {kept}. The reference "
            "backend rounds at the same points, eager ops after every op (docs/ops.md, where "
            "16-bit results are rounded)."
        )
    return f"{text}\n{JOINT_STEP_NOTE}" if report.joint_step else text


def _kernels_text(report) -> str:
    steps = report.view.steps
    free = [k for k in report.kernels if not k.runs_code]
    if not free and not report.fused_kernels:
        text = (
            f"The {report.backend} backend runs each of the {len(steps)} steps as its own "
            "kernel, in the order of the IR above."
        )
        if report.backend == "reference":
            text += (
                " The numba backend (BACKPLAN_BACKEND=numba) fuses them into fewer kernels; "
                "explain() under it lists which."
            )
        return text
    lines = [
        f"{_kernels(report.n_kernels)} for {len(steps)} steps on the {report.backend} "
        f"backend: {report.fused_kernels} fused, and {len(free)} steps that cost no "
        "kernel (views, aliases, literals and loops whose values are recomputed where read)."
    ]
    refused = refused_plans(report)
    if refused:
        lines[0] += (
            f" The {refused} runs on the reference interpreter, one kernel per step "
            "(section 4 says why)."
        )
    compile_line = compile_cost_text(report)
    if compile_line:
        lines.append(compile_line)
    running = [k for k in report.kernels if k.runs_code]  # numbered as they run
    for number, kernel in enumerate(running):
        if kernel.fused:
            members = ", ".join(f"{steps[s].label} {steps[s].op}" for s in kernel.steps)
            kind = "matmul + epilogue" if kernel.epilogue else kernel.kind
            kind = f"row loop of {kernel.stages} stages" if kernel.stages > 1 else kind
            kind += f", {kernel.calls} calls" if kernel.calls > 1 else ""
            lines.append(f"k{number} ({kind}): {members}")
    lines += gemm_lines(report)
    if any(k.epilogue for k in report.kernels):
        lines.append(
            "A matmul + epilogue kernel runs the loop after the product on each block of its "
            "rows as backplan's GEMM finishes it, while it is in cache; where the plan calls "
            "BLAS for that shape, the loop runs right after the call."
        )
    if free:
        lines.append(
            "no kernel: "
            + ", ".join(f"{steps[s].label} {steps[s].op} ({k.kind})" for k in free for s in k.steps)
        )
    return "\n".join(lines)


def gemm_lines(report) -> list[str]:
    """Which GEMM each matmul calls (BLAS, backplan's own, narrow or mixed), as the driver
    the code generator wrote calls it: one line per GEMM, naming its matmul steps."""
    steps, by_gemm = report.view.steps, {}
    for kernel in report.kernels:
        if kernel.gemm:
            step = next((s for s in kernel.steps if steps[s].op == "matmul"), kernel.steps[0])
            matmul = f"{steps[step].label} {steps[step].node.type}"
            by_gemm.setdefault(kernel.gemm, []).append(matmul)
    return [f"{gemm} computes {', '.join(matmuls)}" for gemm, matmuls in by_gemm.items()]


JOINT_STEP_NOTE = (
    "Once two calls in a row had their loss backward()ed from the default seed, a call runs "
    "as one joint plan instead (as value_and_grad, compiled then): it computes the gradients "
    "with the loss and holds them, not saved buffers, until backward() (its peak: section 1's "
    "peak line). Another backward() (another seed, retain_graph) or a call never backward()ed "
    "sends the next calls back to two plans (BACKPLAN_JOINT_STEP=0 keeps two plans always)."
)


def compile_cost_text(report) -> str:
    """What a first call compiles. Loop kernels are shared by every plan and cached on disk, so
    only those never compiled on this machine cost time; how many are cached now (and the
    predicted seconds) is in report.compiled, not in this text, which must not depend on the
    state of the cache."""
    plans = [p for p in report.compiled or [] if p.compiled]
    if not plans:
        return ""
    distinct = {k for p in plans for k in p.loop_kernels}
    return (
        f"A first call compiles at most {len(distinct)} distinct loop kernels (shared by every "
        f"plan and cached on disk); its {len(plans)} plan drivers run as Python calling those "
        "kernels, and from its second call a driver worth compiling runs as machine code emitted "
        "directly from its statements in a fraction of a second (one that cannot be is compiled "
        "in a background process and cached; BACKPLAN_DRIVER=inline compiles them in the first "
        "call instead; bp.compile(..., background=True) runs the first calls on the reference "
        "interpreter and compiles the kernels out of process too)."
    )


def retrace_text(report) -> str:
    dynamic = f" {report.dynamic}" if report.dynamic else ""
    if report.traces <= 1:
        return "Traced once: no retrace." + dynamic
    return (
        f"Traced {report.traces} times. The last retrace happened because: "
        f"{report.retrace_reason or 'the reason was not recorded'}.{dynamic}"
    )
