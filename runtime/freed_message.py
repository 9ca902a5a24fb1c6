"""The GraphFreedError message, written from the facts of the case: which region, created
where, freed by which backward(), whether it saved anything, whether the graph differentiated
now shares it with the one that freed it, and whether one line built both (a loop)."""

from __future__ import annotations

from .errors import FreedFacts, GraphFreedError

MAX_NAMED = 3


def output_desc(region, index: int) -> str:
    """'`matmul` (created at seed.py:26)'; multi-output regions name the output too."""
    which = f" output {index}" if region.program.n_outputs > 1 else ""
    return f"`{region.name}`{which} (created at {region.created_at})"


def freed_facts(freed: list, root) -> FreedFacts:
    region, by = freed[0], freed[0].freed_by
    if by.failed:
        case = "failed"
    elif by.started_from(root):
        case = "same graph"
    else:
        case = "shared"
    return FreedFacts(
        region=region.name,
        created_at=region.created_at,
        freed_by=by.loc,
        saved_buffers=len(region.program.saved_info),
        saved_bytes=region.planned_saved_bytes,
        case=case,
        loop=case == "shared" and by.root_created_at == root.created_at,
        more_freed=tuple(r.name for r in freed[1:]),
    )


def freed_error(freed: list, root, index: int, loc: str) -> GraphFreedError:
    """`freed`: the freed regions backward() would run, in order; the first is described."""
    facts = freed_facts(freed, root)
    lines = [_what_happened(facts, loc)]
    if facts.more_freed:
        lines.append(_more_text(freed[1:]))
    lines += _why(facts, freed[0], root, index)
    lines.append(_fix(facts, freed[0]))
    return GraphFreedError("\n".join(lines), facts)


def _what_happened(facts: FreedFacts, loc: str) -> str:
    head = f"backward() at {loc} reaches region `{facts.region}` (created at {facts.created_at})"
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


def _more_text(freed: list) -> str:
    """'2 more regions upstream were freed by it too: `add`, `matmul` (2 saved buffers,
    48 B).'"""
    names = [f"`{r.name}`" for r in freed]
    shown = ", ".join(names[:MAX_NAMED])
    if len(names) > MAX_NAMED:
        shown += f" and {len(names) - MAX_NAMED} more"
    n_saved = sum(len(r.program.saved_info) for r in freed)
    held = (
        f" ({n_saved} saved buffer{'s' if n_saved != 1 else ''}, "
        f"{sum(r.planned_saved_bytes for r in freed):,} B)"
        if n_saved
        else " (they saved nothing either)"
    )
    n = len(names)
    plural = "s" if n != 1 else ""
    return f"{n} more region{plural} upstream {'are' if n != 1 else 'is'} freed too: {shown}{held}."


def _why(facts: FreedFacts, region, root, index: int) -> list[str]:
    if facts.case == "failed":
        return []
    by = region.freed_by
    if facts.case == "same graph":
        return [
            "This is a second backward() through the same graph: the earlier one also started "
            f"from {by.root_desc}."
        ]
    now = output_desc(root, index)
    if region is root:
        lines = [
            f"That backward() started from {by.root_desc}, a graph built on top of this one, "
            "and freed this region on the way: the graphs share it."
        ]
    else:
        lines = [
            f"The region is shared: that backward() started from {by.root_desc}; the graph you "
            f"differentiate now starts from {now} and is built on the same region."
        ]
    if facts.loop:
        lines.append(
            f"Both graphs were built by the same line, {root.created_at}, as in a loop, on top "
            f"of a region created once, at {region.created_at}."
        )
    return lines


def _fix(facts: FreedFacts, region) -> str:
    if facts.case == "failed":
        return "Fix: run the forward again to build a new graph."
    if facts.case == "same graph":
        return (
            f"Fix: pass retain_graph=True to the backward() at {facts.freed_by} to keep the "
            "graph for another backward(), or run the forward again to build a new graph."
        )
    if facts.loop:
        return (
            f"Fix: compute it inside the loop (move the line {region.created_at} into it) so "
            "each iteration builds its own; or .detach() the reused tensor if no gradient "
            "should flow into it; or pass retain_graph=True to every backward() to keep it "
            "(`del` the tensor holding it after the loop to release it)."
        )
    return (
        f"Fix: pass retain_graph=True to the backward() at {facts.freed_by} to keep the shared "
        "region for this backward(); or compute the shared part again before this graph; or "
        ".detach() the tensor taken from the earlier graph if no gradient should flow into it."
    )
