"""The memory timeline picture of a report: one bar per buffer over the plan's steps (forward
temporaries, saved buffers, gradients...), and below it the total bytes held at each step with
the peak marked. matplotlib is an optional extra, imported only here, only when drawing; the
figure is built without pyplot, so no global plotting state of the user's is touched."""

from __future__ import annotations

import os

from backplan.ir.errors import BackplanError

KIND_COLORS = {
    "temporary": "#9db8d9",
    "saved": "#d9534f",
    "output": "#3b6fb6",
    "cotangent": "#f0ad4e",
    "gradient": "#4cae4c",
    "input": "#bbbbbb",
}
KIND_LABELS = {
    "temporary": "temporary (freed inside the step)",
    "saved": "saved for backward",
    "output": "output (yours after the step)",
    "cotangent": "incoming gradient",
    "gradient": "gradient (yours after the step)",
    "input": "your input, held by reference (not counted)",
}
FORMATS = (".png", ".svg")


class PlotDependencyError(BackplanError, ImportError):
    """Drawing needs matplotlib, which backplan does not require."""


def _rc_context(settings):
    import matplotlib

    return matplotlib.rc_context(settings)


def _load_matplotlib():
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        raise PlotDependencyError(
            "report.plot() needs matplotlib, which is not installed. Install the plot extra: "
            "pip install 'backplan[plot]' (or: pip install matplotlib)"
        ) from None
    return Figure, Patch


def human_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def chosen_buffers(view, max_buffers: int) -> tuple[list, int]:
    """The buffers to draw, in the order they are written, and how many were left out: every
    saved buffer and gradient, then the largest of the rest."""
    buffers = view.timeline_buffers()
    if len(buffers) <= max_buffers:
        return buffers, 0
    rank = sorted(buffers, key=lambda b: (b.saved or b.kind == "gradient", b.nbytes), reverse=True)
    keep = {id(b) for b in rank[:max_buffers]}
    return [b for b in buffers if id(b) in keep], len(buffers) - len(keep)


def plot_report(report, path, max_buffers: int = 60) -> None:
    suffix = os.path.splitext(str(path))[1].lower()
    if suffix not in FORMATS:
        raise BackplanError(f"report.plot({str(path)!r}): write a .png or .svg file")
    figure_class, patch_class = _load_matplotlib()
    view = report.view
    buffers, left_out = chosen_buffers(view, max_buffers)
    n_steps = max(len(view.steps), 1)
    width = min(8.0 + 0.25 * n_steps, 40.0)  # names and legend, then room for every step
    height = 3.2 + 0.24 * max(len(buffers), 4)
    figure = figure_class(figsize=(width, height), dpi=100, layout="constrained")
    bars, total = figure.subplots(
        2, 1, sharex=True, gridspec_kw={"height_ratios": [max(len(buffers), 4) * 0.24, 2.4]}
    )
    _draw_bars(bars, view, buffers)
    _draw_total(total, report)
    _draw_steps(bars, total, view)
    title = f"Memory timeline of one step of {report.name}"
    if left_out:
        title += f" ({left_out} smaller temporaries not drawn)"
    bars.set_title(title, fontsize=12, loc="left")
    kinds = [k for k in KIND_COLORS if any(b.kind == k for b in buffers)]
    handles = [
        patch_class(
            facecolor=KIND_COLORS[k], hatch="//" if k == "input" else None, label=KIND_LABELS[k]
        )
        for k in kinds
    ]
    bars.legend(
        handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False
    )
    with _rc_context({"svg.fonttype": "none"}):  # SVG text stays text: searchable, small
        figure.savefig(path, format=suffix[1:])


def _draw_bars(axes, view, buffers) -> None:
    for row, buf in enumerate(buffers):
        start, end = max(buf.start, 0), min(buf.end, len(view.steps) - 1)
        axes.barh(
            row,
            end - start + 0.8,
            left=start - 0.4,
            height=0.7,
            color=KIND_COLORS[buf.kind],
            edgecolor="#333333",
            linewidth=0.4,
            hatch="//" if buf.kind == "input" else None,
        )
    axes.set_yticks(range(len(buffers)))
    axes.set_yticklabels([_bar_label(view, b) for b in buffers], fontsize=8)
    axes.set_ylim(max(len(buffers), 1) - 0.5, -0.5)
    axes.set_ylabel("buffer (name = op, bytes)")
    axes.grid(axis="x", color="#eeeeee")


def _bar_label(view, buf) -> str:
    prefix = "bwd " if buf.phase == "backward" and buf.name.startswith("%") else ""
    op = f" = {view.steps[buf.producer].op}" if buf.producer is not None else ""
    return f"{prefix}{buf.name}{op}  {buf.type}  {human_bytes(buf.nbytes)}"


def byte_unit(peak: int) -> tuple[str, int]:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if peak >= 4 * size:
            return unit, size
    return "B", 1


def _draw_total(axes, report) -> None:
    unit, size = byte_unit(report.reference_peak_bytes)
    live = [b / size for b in report.live_bytes]
    steps = list(range(len(live)))
    axes.step(steps, live, where="mid", color="#222222", linewidth=1.5)
    axes.fill_between(steps, live, step="mid", color="#cccccc", alpha=0.5)
    peak_step = report.reference_peak_step
    if peak_step is not None:
        peak = report.reference_peak_bytes / size
        axes.plot([peak_step.index], [peak], marker="o", color="#d9534f", markersize=8)
        text = (
            f"peak {human_bytes(report.reference_peak_bytes)} at {peak_step.label} ({peak_step.op})"
        )
        right = peak_step.index > 0.6 * len(live)
        axes.annotate(
            text,
            (peak_step.index, peak),
            xytext=(-10 if right else 10, 6),
            textcoords="offset points",
            ha="right" if right else "left",
            va="bottom",
            fontsize=10,
            color="#b03030",
            fontweight="bold",
        )
        axes.set_ylim(0, peak * 1.25 if peak else 1)
    axes.set_ylabel(f"bytes held ({unit})")
    axes.set_xlabel("step (fN = forward step N, bN = backward step N)")
    axes.grid(axis="y", color="#eeeeee")


def _draw_steps(bars, total, view) -> None:
    steps = view.steps
    every = max(1, len(steps) // 40)
    ticks = list(range(0, len(steps), every))
    total.set_xticks(ticks)
    total.set_xticklabels(
        [steps[i].label for i in ticks], fontsize=8, rotation=90 if len(steps) > 20 else 0
    )
    total.set_xlim(-0.6, max(len(steps) - 0.4, 0.6))
    first_backward = next((s.index for s in steps if s.phase == "backward"), None)
    if first_backward is not None:
        for axes in (bars, total):
            axes.axvline(first_backward - 0.5, color="#666666", linestyle="--", linewidth=1)
        total.text(
            first_backward - 0.3,
            0.03,
            "backward starts",
            fontsize=9,
            color="#444444",
            va="bottom",
            transform=total.get_xaxis_transform(),
        )
