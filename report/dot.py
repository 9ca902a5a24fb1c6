"""Graphviz DOT of a report: the forward and backward graphs side by side, with each saved buffer
drawn as its own node between the op that produces it and the backward ops that read it, the
way these graphs are drawn on whiteboards. Render with `dot -Tsvg step.dot -o step.svg`."""

from __future__ import annotations

from backplan.ir.text import format_loc

KIND_STYLE = {
    "input": 'shape=box, style="rounded,filled", fillcolor="#e8e8e8"',
    "cotangent": 'shape=box, style="rounded,filled", fillcolor="#fde2c8"',
    "gradient": 'shape=box, style="rounded,filled,bold", fillcolor="#c8f0c8"',
    "output": 'shape=box, style="rounded,filled,bold", fillcolor="#c8dcf5"',
}
OP_STYLE = 'shape=box, style="filled", fillcolor="#ffffff"'
SAVED_STYLE = 'shape=cylinder, style="filled", fillcolor="#f7c6c6", color="#b03030"'


def quote(text: str) -> str:
    """A DOT double-quoted string; newlines become centred line breaks."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + escaped.replace("\n", "\\n") + '"'


def report_dot(report) -> str:
    view = report.view
    lines = [
        f"digraph {quote(report.name)} {{",
        '  graph [rankdir=TB, fontname="Helvetica", newrank=true];',
        '  node [fontname="Helvetica", fontsize=10];',
        '  edge [fontname="Helvetica", fontsize=9, color="#555555"];',
    ]
    for phase in ("forward", "backward"):
        body = _cluster_body(view, phase)
        if body:
            lines.append(f"  subgraph cluster_{phase} {{")
            lines.append(f'    label={quote(phase)}; style=dashed; color="#999999";')
            lines.extend(f"    {line}" for line in body)
            lines.append("  }")
    saved = {b.key: b for b in view.buffers.values() if b.saved}
    infos = {info.name: info for info in report.saved_buffers}
    for key, buf in saved.items():
        lines.append(
            f"  {quote('saved:' + key)} [{SAVED_STYLE}, "
            f"label={quote(_saved_label(buf, infos.get(buf.name)))}];"
        )
    lines.extend(f"  {edge}" for edge in _edges(view, saved))
    lines.append("}")
    return "\n".join(lines) + "\n"


def _cluster_body(view, phase: str) -> list[str]:
    body = []
    for buf in view.buffers.values():
        if buf.producer is None and buf.phase == phase:
            kind = buf.kind if buf.kind in KIND_STYLE else "input"
            label = f"{buf.name}\n{buf.type}"
            body.append(f"{quote(buf.key)} [{KIND_STYLE[kind]}, label={quote(label)}];")
    for step in view.steps:
        if step.phase != phase:
            continue
        buf = view.buffers[step.writes]
        style = KIND_STYLE[buf.kind] if buf.kind in ("output", "gradient") else OP_STYLE
        label = f"{step.label}: {buf.name} = {step.op}\n{step.node.type}"
        if step.node.loc:
            label += f"\n{format_loc(step.node.loc)}"
        body.append(f"{quote(step.writes)} [{style}, label={quote(label)}];")
    return body


def _saved_label(buf, info) -> str:
    label = f"saved {buf.name}\n{buf.type}, {buf.nbytes:,} B"
    if info is not None:
        label += f"\n{info.reason}\nfreed after b{info.last_read_step}"
    return label


def _edges(view, saved: dict) -> list[str]:
    edges = []
    for key in saved:
        edges.append(f'{quote(key)} -> {quote("saved:" + key)} [color="#b03030", penwidth=1.5];')
    for step in view.steps:
        for read in dict.fromkeys(step.reads):
            if read in saved and step.phase == "backward":
                edges.append(
                    f"{quote('saved:' + read)} -> {quote(step.writes)} "
                    f'[color="#b03030", label={quote(step.label)}];'
                )
            else:
                edges.append(f"{quote(read)} -> {quote(step.writes)};")
    return edges
