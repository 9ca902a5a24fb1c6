"""MkDocs hook: the ops reference from the ops' own docstrings.

Many ops are made by small factories (`_unary("exp", ...)`), so static analysis sees no function
to document; this hook imports backplan and writes one section per public op in place of the
`<!-- bp-ops -->` marker, in the order of the page's name list."""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from doctest_fences import fence_doctests  # noqa: E402

MARKER = re.compile(r"<!-- bp-ops: ([\w ,]+) -->")


def op_section(name: str) -> str:
    import backplan as bp

    fn = getattr(bp, name)
    same = fn.__name__ if fn.__name__ != name and fn.__name__ in bp.__all__ else None
    body = f"The same function as [`bp.{same}`](#bp{same})." if same else inspect.getdoc(fn)
    if not body:
        raise ValueError(f"bp.{name} has no docstring for the ops reference")
    return f"## `bp.{name}`\n\n{fence_doctests(body)}\n"


def on_page_markdown(markdown: str, page, **kwargs) -> str:
    def sections(match: re.Match) -> str:
        names = [n.strip() for n in match.group(1).split(",") if n.strip()]
        return "\n".join(op_section(n) for n in names)

    return MARKER.sub(sections, markdown)
