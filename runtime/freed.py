"""The facts of a GraphFreedError: which region backward() reached, created where, freed by
which backward(), what it and the regions freed with it had saved, and how the two graphs
relate. report/freed_message.py writes the message from them (runtime/wording.py)."""

from __future__ import annotations

from .errors import FreedFacts, GraphFreedError
from .saved_once import planned_totals
from .wording import written


def output_desc(region, index: int) -> str:
    """'`matmul` (created at seed.py:26)'; multi-output regions name the output too."""
    which = f" output {index}" if region.program.n_outputs > 1 else ""
    return f"`{region.name}`{which} (created at {region.created_at})"


def freed_facts(freed: list, root, index: int, loc: str) -> FreedFacts:
    """`freed`: the freed regions backward() would run, in order; the first is described."""
    region, by, more = freed[0], freed[0].freed_by, freed[1:]
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
        more_freed=tuple(r.name for r in more),
        backward_at=loc,
        more_saved_buffers=sum(len(r.program.saved_info) for r in more),
        more_saved_bytes=_once(more),
        earlier_root=by.root_desc,
        now_root=output_desc(root, index),
        reached_root=region is root,
        root_created_at=root.created_at,
    )


def _once(regions) -> int:
    """Bytes the regions saved, each array once (eager `x * bp.exp(x)`: exp saves its output
    and mul saves the same array as its input)."""
    totals = planned_totals(regions)
    return totals.allocated + totals.yours


def freed_error(freed: list, root, index: int, loc: str) -> GraphFreedError:
    facts = freed_facts(freed, root, index, loc)
    short = (
        f"backward() at {loc} reaches region `{facts.region}` (created at {facts.created_at}), "
        f"already freed by the backward() at {facts.freed_by}"
    )
    return GraphFreedError(written("graph_freed", facts, short), facts)
