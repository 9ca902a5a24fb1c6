"""The explain() text of a loaded artifact: signature, plan sizes, peak bytes and the buffers
kept from forward for backward, read from the plans alone (no model code needed)."""

from __future__ import annotations

from backplan.ir.liveness import Plan
from backplan.ir.text import format_loc, value_names


def _header(loaded) -> list[str]:
    made_by = loaded.manifest.get("backplan_version", "unknown")
    return [
        f"{loaded.name}: {loaded.kind} loaded from {loaded.path} "
        f"(artifact format {loaded.format_version}, written by backplan {made_by})",
        f"signature: {loaded.signature}",
    ]


def _plan_line(label: str, plan: Plan) -> str:
    return (f"{label}: {len(plan.graph.nodes)} steps, peak {plan.peak_bytes} B held by the plan "
            "(its own values and owned inputs)")


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    rows = [header, *rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
            for r in rows]


def region_report(loaded) -> str:
    program = loaded.program
    lines = _header(loaded)
    lines.append(_plan_line("forward plan", program.plans.forward))
    if program.plans.backward is None:
        lines.append("backward plan: none (no input was exported requiring grad)")
        return "\n".join(lines)
    lines.append(_plan_line("backward plan", program.plans.backward))
    infos = program.saved_info
    total = sum(i.nbytes for i in infos)
    lines.append(f"saved for backward: {len(infos)} buffer(s), {total} B held from each forward "
                 "call until its backward frees them")
    rows = [(i.name, str(list(i.shape)), i.dtype, str(i.nbytes), f"{i.op} at {i.produced_at}",
             "; ".join(i.read_by), str(i.last_read_step), i.reason) for i in infos]
    header = ("name", "shape", "dtype", "bytes", "produced by", "read by", "freed after step",
              "why saved")
    lines.extend(_table(header, rows))
    return "\n".join(lines)


def joint_report(loaded) -> str:
    plan = loaded.plan
    lines = _header(loaded)
    lines.append(_plan_line("joint plan (forward and backward in one)", plan))
    kept = kept_across_loss(plan)
    total = sum(v.type.nbytes for v, _ in kept)
    lines.append(f"kept from forward for the gradient steps: {len(kept)} value(s), {total} B")
    names = value_names(plan.graph)
    rows = []
    for value, readers in kept:
        made = "input" if value.op == "input" else f"{value.op} at {format_loc(value.loc)}"
        rows.append((names[value], str(value.type), str(value.type.nbytes), made,
                     "; ".join(f"{r.op} at {format_loc(r.loc)}" for r in readers),
                     str(plan.last_read.get(value, -1))))
    lines.extend(_table(("name", "type", "bytes", "produced by", "read by", "freed after step"),
                        rows))
    return "\n".join(lines)


def kept_across_loss(plan: Plan) -> list:
    """Values computed by the step that makes the loss (or earlier) and read after it: what a
    separate backward would have to save."""
    graph = plan.graph
    loss = graph.outputs[0]
    boundary = graph.nodes.index(loss) if loss in graph.nodes else -1
    kept = []
    for value in graph.inputs + graph.nodes[: boundary + 1]:
        readers = [n for n in graph.nodes[boundary + 1 :] if value in n.inputs]
        if readers:
            kept.append((value, readers))
    return kept
