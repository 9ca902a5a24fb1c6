"""Where report's wording meets the runtime objects that speak to users. The runtime states
facts (a GraphFreedError's FreedFacts, a region's saved buffers); the sentences and tables are
written in report/ (report/freed_message.py, report/region_text.py), which sits above runtime
and so cannot be imported from here: it registers its writers when it is imported, which
`import backplan` does before any region exists. Without them (runtime used alone) each object
says its short form.
"""

from __future__ import annotations

from collections.abc import Callable

_writers: dict[str, Callable] = {}


def register(kind: str, writer: Callable) -> None:
    """kind: "graph_freed" (FreedFacts -> message) or "region" (Region -> its table)."""
    _writers[kind] = writer


def written(kind: str, subject, short: str) -> str:
    """The registered writer's text for subject, or short when none is registered."""
    writer = _writers.get(kind)
    return short if writer is None else writer(subject)
