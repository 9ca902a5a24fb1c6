"""The guide cannot rot: every ```python block of README.md and docs/**/*.md runs here (each
page's blocks in order, in one namespace, in a fresh folder), and the site builds with
`mkdocs build --strict`.

A block that is deliberately not run carries `<!-- skip: why -->` on the line before it; a block
that shows an error carries `<!-- raises NameOfError -->` and must raise it. Skips stay few.
Blocks run on the reference interpreter (the suite's BACKPLAN_BACKEND), so they compile nothing.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest

import backplan as bp

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
MARKER = re.compile(r"<!--\s*(skip|raises)\b:?\s*([^>]*?)\s*-->")
MAX_SKIPPED = 6


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # the first code line, 1-based
    code: str
    skip: str | None = None  # why it is not run
    raises: str | None = None  # the error it must raise


def python_blocks(page: Path) -> list[Block]:
    """The ```python blocks of a Markdown page, with the marker on the line before each."""
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() != "```python":
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        before = lines[i - 1] if i else ""
        marker = MARKER.search(before)
        kind, detail = marker.groups() if marker else (None, None)
        blocks.append(
            Block(
                page,
                i + 2,
                "\n".join(lines[i + 1 : end]),
                skip=(detail or "no reason given") if kind == "skip" else None,
                raises=detail if kind == "raises" else None,
            )
        )
        i = end + 1
    return blocks


def run_page(blocks: list[Block]) -> None:
    """Runs the page's blocks in order in one namespace, a module of its own (dataclasses look
    their module up); line numbers in tracebacks are the page's own."""
    module = types.ModuleType("docs_page")
    sys.modules[module.__name__] = module
    try:
        run_blocks(blocks, module.__dict__)
    finally:
        del sys.modules[module.__name__]


def run_blocks(blocks: list[Block], namespace: dict) -> None:
    for block in blocks:
        if block.skip:
            continue
        code = compile("\n" * (block.line - 1) + block.code, str(block.page), "exec")
        if block.raises is None:
            exec(code, namespace)
            continue
        with pytest.raises(Exception) as caught:
            exec(code, namespace)
        names = [cls.__name__ for cls in type(caught.value).__mro__]
        assert block.raises in names, (
            f"{block.page.name}:{block.line} should raise {block.raises}, raised {names[0]}: "
            f"{caught.value}"
        )


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


RUNNABLE = [page for page in PAGES if python_blocks(page)]


@pytest.mark.filterwarnings("ignore::backplan.Float64PromotionWarning")  # float64 meant here
@pytest.mark.parametrize("page", RUNNABLE, ids=page_id)
def test_every_python_block_of_the_page_runs(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(page.parent))  # examples beside a page import by name
    run_page(python_blocks(page))


def test_blocks_left_unrun_are_few_and_say_why():
    skipped = [b for page in PAGES for b in python_blocks(page) if b.skip]
    where = [f"{b.page.name}:{b.line} ({b.skip})" for b in skipped]
    assert len(skipped) <= MAX_SKIPPED, f"too many unrun blocks: {where}"
    assert all(b.skip != "no reason given" for b in skipped), where


def test_a_block_that_should_raise_and_does_not_fails(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- raises GraphFreedError -->\n```python\nx = 1\n```\n")
    with pytest.raises(pytest.fail.Exception):
        run_page(python_blocks(page))
    page.write_text(
        "```python\nimport backplan as bp\n```\n\n```python\nprint(no_such_name)\n```\n"
    )
    with pytest.raises(NameError) as caught:
        run_page(python_blocks(page))
    assert caught.traceback[-1].lineno == 5  # 0-based: the name is on the page's sixth line


PRINTS_AS = re.compile(r"<!--\s*prints as (\w+\.py)\s*-->")


def printed_outputs(page: Path) -> list[tuple[Block, str, str]]:
    """(python block, file name, text) for each ```text block marked `<!-- prints as NAME.py
    -->`: the text is what the python block before it prints, run alone as that file."""
    lines = page.read_text().splitlines()
    blocks = python_blocks(page)
    found = []
    for i, line in enumerate(lines):
        marker = PRINTS_AS.search(line)
        if not marker or i + 1 >= len(lines) or lines[i + 1].strip() != "```text":
            continue
        end = next(j for j in range(i + 2, len(lines)) if lines[j].strip() == "```")
        block = max((b for b in blocks if b.line < i), key=lambda b: b.line)
        found.append((block, marker.group(1), "\n".join(lines[i + 2 : end])))
    return found


PRINTED = [(page, *found) for page in PAGES for found in printed_outputs(page)]


@pytest.mark.parametrize(
    "page, block, name, text", PRINTED, ids=[f"{page_id(p)}:{b.line}" for p, b, _, _ in PRINTED]
)
def test_a_printed_output_the_guide_shows_is_what_its_block_prints(
    page, block, name, text, tmp_path
):
    """An output shown as a script's (file names and line numbers in it) is that script's:
    the block saved as the named file and run in a fresh process prints exactly the text."""
    (tmp_path / name).write_text(block.code + "\n")
    env = {**os.environ, "BACKPLAN_QUIET": "1"}
    run = subprocess.run(
        [sys.executable, name], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.rstrip("\n") == text, f"{page_id(page)}:{block.line} prints:\n{run.stdout}"


def test_the_guide_shows_printed_outputs():
    assert any(page.name == "explain.md" for page, *_ in PRINTED)  # the freed-graph error


def test_every_public_name_has_an_api_reference_entry():
    """Functions no page names with `::: backplan.NAME` land on the ops page (its hook lists
    them); every class, exception and warning needs an entry of its own."""
    pages = "\n".join(p.read_text() for p in (ROOT / "docs" / "api").glob("*.md"))
    assert "<!-- bp-ops -->" in pages
    entries = re.findall(r"^::: (backplan[\w.]*)", pages, re.MULTILINE)
    repeated = sorted({e for e in entries if entries.count(e) > 1})
    assert not repeated, f"documented twice in docs/api: {repeated}"
    documented = {e.split(".", 1)[1] for e in entries if e.count(".") == 1}
    modules = {"nn", "optim", "random", "tree"}
    dtypes = {"bool_", "bfloat16", "float16", "float32", "float64", "int32", "int64", "uint8"}
    classes = {n for n in bp.__all__ if isinstance(getattr(bp, n), type)} - dtypes
    missing = classes - documented
    assert not missing, f"public classes without an API reference entry: {sorted(missing)}"
    others = set(bp.__all__) - classes - dtypes - modules
    assert all(callable(getattr(bp, n)) for n in others), "a public name the hook cannot list"


def test_the_site_builds_strictly(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip('mkdocs is not installed: pip install -e ".[docs]"')
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    reference = (tmp_path / "api" / "compile" / "index.html").read_text()
    assert "Trace fn on its first call per signature" in reference  # bp.compile's docstring
    ops = (tmp_path / "api" / "ops" / "index.html").read_text()
    assert "Integer input gives float64" in ops  # a factory-made op's docstring (bp.exp)


# `dir/` or `dir/file.py`
PATH_IN_TICKS = re.compile(
    r"`([\w.\-]+(?:/[\w.\-*]+)*/(?:[\w.\-*]+\.(?:py|md|toml|json|yml|png))?)`"
)
CHECKED_PAGES = ["README.md", "ARCHITECTURE.md", "BENCHMARKS.md"]


def named_paths(text: str) -> set[str]:
    """Repository paths a page names in backticks: `ir/pipeline.py`, `codegen/render/`."""
    return {m for m in PATH_IN_TICKS.findall(text) if not m.startswith(("~", "/", "."))}


def test_paths_the_guide_names_exist():
    """Files move (codegen/ was split into rooms); a page naming an old path fails here. The
    benchmark history keeps the paths of its day."""
    pages = [ROOT / name for name in CHECKED_PAGES]
    pages += [p for p in (ROOT / "docs").rglob("*.md") if p.name != "benchmarks-history.md"]
    missing = [
        f"{page.relative_to(ROOT)}: {path}"
        for page in pages
        for path in sorted(named_paths(page.read_text()))
        if not list(ROOT.glob(path.rstrip("/")))
    ]
    assert not missing, f"paths named in the docs that do not exist: {missing}"
    assert "ir/pipeline.py" in named_paths((ROOT / "ARCHITECTURE.md").read_text())
