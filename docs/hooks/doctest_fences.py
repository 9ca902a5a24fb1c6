"""Griffe extension: docstring examples written as doctest (`>>>` lines and their output) are
rendered as code. Left as Markdown, an example's `[1.0, 2.0]` output under a `[...]` input line
reads as a reference link, and `mkdocs build --strict` fails on it."""

from __future__ import annotations

import griffe


def fence_doctests(text: str) -> str:
    """Wraps each run of lines starting with `>>>` (with its output lines) in a pycon fence."""
    out, in_example = [], False
    for line in text.splitlines():
        starts = line.lstrip().startswith(">>>")
        if starts and not in_example:
            out.append("```pycon")
            in_example = True
        elif in_example and not line.strip():
            out.append("```")
            in_example = False
        out.append(line)
    if in_example:
        out.append("```")
    return "\n".join(out)


class DoctestFences(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None and ">>>" in obj.docstring.value:
            obj.docstring.value = fence_doctests(obj.docstring.value)
