"""The explain() report as text: summary, plans, saved buffers, kernels, retracing."""

from __future__ import annotations

import textwrap

from backplan.ir.text import format_loc

from .saved_table import format_saved_table

WIDTH = 100


def format_bytes(n: int) -> str:
    """'48 B', '12,288 B (12.0 KiB)', '3,145,728 B (3.0 MiB)'."""
    if n < 10 * 1024:
        return f"{n:,} B"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n:,} B ({n / size:.1f} {unit})"
    return f"{n:,} B"


def render_report(report) -> str:
    sections = [
        (f"explain: {report.name}", ""),
        ("1. Summary", _wrap(summary_text(report))),
        ("2. Plans", plans_text(report)),
        (f"3. Saved buffers ({len(report.saved_buffers)}, {format_bytes(report.saved_bytes)})",
         format_saved_table(report.saved_buffers)),
        ("4. Kernels", _wrap(kernels_text(report))),
        ("5. Retracing", _wrap(retrace_text(report))),
    ]
    return "\n\n".join(f"{title}\n{body}".rstrip() for title, body in sections) + "\n"


def _wrap(text: str) -> str:
    return "\n".join(textwrap.fill(p, WIDTH, initial_indent="  ", subsequent_indent="  ")
                     for p in text.split("\n"))


def summary_text(report) -> str:
    fused = report.fused_kernels
    fusion = f"{fused} of them fused" if fused else "none fused"
    if report.backend == "reference" and not fused:
        fusion = "the reference interpreter runs each IR node on its own"
    parts = [f"{report.name} has {report.n_forward_steps} forward and "
             f"{report.n_backward_steps} backward steps, run as {report.n_kernels} kernels on the "
             f"{report.backend} backend ({fusion})."]
    parts.append(_saved_sentence(report))
    parts.append(_peak_sentence(report))
    parts.append(_freeing_sentence(report))
    if report.backend != "reference":
        parts.append(
            "Bytes and lifetimes follow the plan as the reference interpreter runs it, every IR "
            f"value its own buffer; the {report.backend} backend allocates only values that "
            "leave a fused loop, and holds saved buffers and incoming gradients until its "
            "backward call returns.")
    return " ".join(p for p in parts if p)


def _saved_sentence(report) -> str:
    if not any(report.requires_grad):
        return ("Nothing needs a gradient (no input requires grad, or grad mode is off), so "
                "there is no backward and nothing is saved.")
    n = len(report.saved_buffers)
    if n == 0:
        return "The backward needs no forward values: nothing is saved."
    text = (f"The forward keeps {n} saved buffer{'s' if n != 1 else ''} for the backward, "
            f"{format_bytes(report.saved_bytes)} in total")
    if report.saved_input_bytes:
        text += (f" ({format_bytes(report.saved_input_bytes)} of them your own inputs, held by "
                 "reference, not copied)")
    return text + "."


def _peak_sentence(report) -> str:
    step = report.peak_step
    if step is None:
        return ""
    where = f"at {step.label}, {step.op}"
    if step.node.loc:
        where += f" at {format_loc(step.node.loc)}"
    text = f"Predicted peak: {format_bytes(report.forward_peak_bytes)} during the forward"
    if report.n_backward_steps:
        text += f", {format_bytes(report.backward_peak_bytes)} during the backward"
    text += (f", {format_bytes(report.peak_bytes)} over the whole step ({where}), not counting "
             f"the {format_bytes(report.input_bytes)} of arrays you pass in.")
    return text


def _freeing_sentence(report) -> str:
    if not any(report.requires_grad):
        return ""
    if report.view.joint:
        return ("value_and_grad runs forward and backward as one plan: saved buffers live only "
                "inside the call, each freed after its last read; nothing is held afterwards, "
                "so there is no graph to free or retain.")
    return ("Each call builds a new graph that holds its own saved buffers until backward(), "
            "which frees each right after its last read (the lifetime column); graphs built "
            "later on its outputs share it, so the first backward() through any of them frees "
            "it. A second backward() through a freed graph always raises GraphFreedError, "
            "saved buffers or not, unless the first passed retain_graph=True. "
            "print(out.grad_fn) shows which buffers are freed.")


def plans_text(report) -> str:
    lines = []
    for name, plan in report.plans.items():
        title = {"forward": "forward IR", "backward": "backward IR",
                 "joint": "joint IR (forward steps fN, then backward steps bN, in one plan)"}[name]
        lines.append(f"  {title}")
        lines.extend(f"    {legend}" for legend in _input_legend(report, name, plan))
        lines.extend(_gutter(plan.text(), _labels(report, name)))
        lines.append("")
    return "\n".join(lines).rstrip()


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
        return [f"%{i} = {report.view.buffers[f'f%{i}'].name}: {v.type}"
                + (", requires grad" if i < len(report.requires_grad) and report.requires_grad[i]
                   else "") for i, v in enumerate(inputs)]
    n_cot = sum(1 for v in inputs if v.role == "cotangent")
    legend = []
    for i, value in enumerate(inputs):
        if value.role == "cotangent":
            legend.append(f"%{i} = {report.view.buffers[f'b%{i}'].name}: the gradient flowing "
                          "into that forward output")
        else:
            legend.append(f"%{i} = saved {report.saved_buffers[i - n_cot].name}")
    return legend


def kernels_text(report) -> str:
    steps = report.view.steps
    if len(report.kernels) == len(steps):
        text = (f"The {report.backend} backend runs each of the {len(steps)} steps as its own "
                "kernel, in the order of the IR above.")
        if report.backend == "reference":
            text += (" The numba backend (BACKPLAN_BACKEND=numba) fuses them into fewer kernels; "
                     "explain() under it lists which.")
        return text
    free = [k for k in report.kernels if not k.runs_code]
    lines = [f"{report.n_kernels} kernels for {len(steps)} steps on the {report.backend} "
             f"backend: {report.fused_kernels} fused, and {len(free)} steps that cost no "
             "kernel (views, aliases and literals)."]
    for number, kernel in enumerate(report.kernels):
        if kernel.fused and kernel.runs_code:
            members = ", ".join(f"{steps[s].label} {steps[s].op}" for s in kernel.steps)
            lines.append(f"k{number} ({kernel.kind}): {members}")
    if free:
        lines.append("no kernel: " + ", ".join(
            f"{steps[s].label} {steps[s].op} ({k.kind})" for k in free for s in k.steps))
    return "\n".join(lines)


def retrace_text(report) -> str:
    if report.traces <= 1:
        return "Traced once: no retrace."
    return (f"Traced {report.traces} times. The last retrace happened because: "
            f"{report.retrace_reason or 'the reason was not recorded'}.")
