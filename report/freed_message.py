"""The GraphFreedError message, written from the facts of the case (runtime/freed.py): which
region, created where, freed by which backward(), whether it saved anything, whether the graph
differentiated now shares it with the one that freed it, and whether one line built both (a
loop). Registered with runtime/wording.py, so the runtime raises it with this text."""

from __future__ import annotations

from backplan.runtime.errors import FreedFacts

MAX_NAMED = 3


def freed_message(facts: FreedFacts) -> str:
    lines = [_what_happened(facts)]
    if facts.more_freed:
        lines.append(_more_text(facts))
    lines += _why(facts)
    lines.append(_fix(facts))
    return "\n".join(lines)


def _what_happened(facts: FreedFacts) -> str:
    head = (
        f"backward() at {facts.backward_at} reaches region `{facts.region}` "
        f"(created at {facts.created_at})"
    )
    if facts.case == "failed":
        return (
            f"{head}, which the backward() at {facts.freed_by} was running when it failed; "
            "its saved buffers may have been released or reused, so they cannot be trusted."
        )
    if facts.saved_buffers == 0:
        return (
            f"{head}. It saved nothing, but the graph was released by the backward() at "
            f"{facts.freed_by}: a graph runs backward once."
        )
    n = facts.saved_buffers
    return (
        f"{head}, whose {n} saved buffer{'s' if n != 1 else ''} ({facts.saved_bytes:,} B) "
        f"the backward() at {facts.freed_by} already freed."
    )


def _more_text(facts: FreedFacts) -> str:
    """'2 more regions upstream were freed by it too: `add`, `matmul` (2 saved buffers,
    48 B).'"""
    names = [f"`{name}`" for name in facts.more_freed]
    shown = ", ".join(names[:MAX_NAMED])
    if len(names) > MAX_NAMED:
        shown += f" and {len(names) - MAX_NAMED} more"
    n_saved = facts.more_saved_buffers
    held = (
        f" ({n_saved} saved buffer{'s' if n_saved != 1 else ''}, {facts.more_saved_bytes:,} B)"
        if n_saved
        else " (they saved nothing either)"
    )
    n = len(names)
    plural = "s" if n != 1 else ""
    return f"{n} more region{plural} upstream {'are' if n != 1 else 'is'} freed too: {shown}{held}."


def _why(facts: FreedFacts) -> list[str]:
    if facts.case == "failed":
        return []
    if facts.case == "same graph":
        return [
            "This is a second backward() through the same graph: the earlier one also started "
            f"from {facts.earlier_root}."
        ]
    if facts.reached_root:
        lines = [
            f"That backward() started from {facts.earlier_root}, a graph built on top of this "
            "one, and freed this region on the way: the graphs share it."
        ]
    else:
        lines = [
            f"The region is shared: that backward() started from {facts.earlier_root}; the "
            f"graph you differentiate now starts from {facts.now_root} and is built on the "
            "same region."
        ]
    if facts.loop:
        lines.append(
            f"Both graphs were built by the same line, {facts.root_created_at}, as in a loop, "
            f"on top of a region created once, at {facts.created_at}."
        )
    return lines


def _fix(facts: FreedFacts) -> str:
    if facts.case == "failed":
        return "Fix: run the forward again to build a new graph."
    if facts.case == "same graph":
        return (
            f"Fix: pass retain_graph=True to the backward() at {facts.freed_by} to keep the "
            "graph for another backward(), or run the forward again to build a new graph."
        )
    if facts.loop:
        return (
            f"Fix: compute it inside the loop (move the line {facts.created_at} into it) so "
            "each iteration builds its own; or .detach() the reused tensor if no gradient "
            "should flow into it; or pass retain_graph=True to every backward() to keep it "
            "(`del` the tensor holding it after the loop to release it)."
        )
    return (
        f"Fix: pass retain_graph=True to the backward() at {facts.freed_by} to keep the shared "
        "region for this backward(); or compute the shared part again before this graph; or "
        ".detach() the tensor taken from the earlier graph if no gradient should flow into it."
    )
