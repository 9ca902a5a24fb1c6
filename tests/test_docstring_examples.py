"""The API reference cannot rot either: every `>>>` example in the docstrings it renders (each
`::: backplan.NAME` entry of docs/api, what those modules hold, and every public function the
ops page lists) runs here and prints what it shows. tests/test_docs runs the guide's pages;
these are not on them."""

from __future__ import annotations

import doctest
import importlib
import re
from pathlib import Path

import numpy as np
import pytest

import backplan as bp

API = Path(__file__).resolve().parent.parent / "docs" / "api"
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _resolve(dotted: str):
    """backplan.optim -> the module; backplan.interop.torch.from_torch -> the function."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:k]))
        except ImportError:
            continue
        for name in parts[k:]:
            target = getattr(target, name)
        return target
    raise ImportError(dotted)


def rendered_examples() -> list[doctest.DocTest]:
    """The doctests of every object docs/api renders, each once: its entries, and the ops
    page's list of every public function no entry names (its hook)."""
    entries = {
        e for page in API.glob("*.md") for e in re.findall(r"^::: (\S+)", page.read_text(), re.M)
    }
    entries = sorted(entries | {f"backplan.{name}" for name in bp.__all__})
    finder = doctest.DocTestFinder(exclude_empty=True)
    tests, seen = [], set()
    for entry in entries:
        try:
            target = _resolve(entry)
        except ImportError:  # an optional extra (torch) that is not installed
            continue
        for test in finder.find(target, entry, extraglobs={"np": np, "bp": bp}):
            if test.examples and test.name not in seen:
                seen.add(test.name)
                tests.append(test)
    return tests


EXAMPLES = rendered_examples()


@pytest.mark.parametrize("test", EXAMPLES, ids=[t.name for t in EXAMPLES])
def test_an_api_reference_example_prints_what_it_shows(test, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples that write files write them here
    failures: list[str] = []
    result = doctest.DocTestRunner(optionflags=FLAGS).run(test, out=failures.append)
    assert result.failed == 0, "".join(failures)


def test_the_api_reference_has_examples_to_run():
    names = {t.name for t in EXAMPLES}
    assert len(EXAMPLES) >= 20 and "backplan.live_saved_bytes" in names, sorted(names)
