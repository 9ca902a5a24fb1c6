"""MkDocs hook: the ops reference from the ops' own docstrings.

Many ops are made by small factories (`_unary("exp", ...)`), so static analysis sees no function
to document; this hook imports backplan and writes, in place of the `<!-- bp-ops -->` marker,
one section per public function that no other API page documents with `::: backplan.NAME`, in
alphabetical order: a new op appears without editing the docs."""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from doctest_fences import fence_doctests  # noqa: E402

MARKER = "<!-- bp-ops -->"
DOCUMENTED = re.compile(r"^::: backplan\.(\w+)", re.MULTILINE)


def op_section(name: str) -> str:
    import backplan as bp

    fn = getattr(bp, name)
    same = fn.__name__ if fn.__name__ != name and fn.__name__ in bp.__all__ else None
    body = f"The same function as [`bp.{same}`](#bp{same})." if same else inspect.getdoc(fn)
    if not body:
        raise ValueError(f"bp.{name} has no docstring for the ops reference")
    return f"## `bp.{name}`\n\n{fence_doctests(body)}\n"


def op_names(api_folder: Path) -> list[str]:
    """Public functions of backplan not documented on another API page."""
    import backplan as bp

    pages = "\n".join(page.read_text() for page in api_folder.glob("*.md"))
    elsewhere = set(DOCUMENTED.findall(pages))
    public = [n for n in bp.__all__ if inspect.isfunction(getattr(bp, n, None))]
    return sorted(n for n in public if n not in elsewhere)


def on_page_markdown(markdown: str, page, config, **kwargs) -> str:
    if MARKER not in markdown:
        return markdown
    names = op_names(Path(config["docs_dir"]) / "api")
    return markdown.replace(MARKER, "\n".join(op_section(n) for n in names))
