"""No import cycles inside a folder: module A importing B while B imports A (directly or round
a longer loop) is a design knot, whether or not a lazy import inside a function hides it from
Python. Imports are read with ast, as tests/test_layering.py reads them."""

from __future__ import annotations

import ast
from pathlib import Path

from test_layering import ROOT, imported_modules, module_name

FOLDERS = (
    "ir", "codegen", "runtime", "report", "tracer", "artifacts", "optim", "distributed", "bench",
    "backplan",
)  # fmt: skip


def import_graph(folder: str, root: Path = ROOT) -> dict[str, set[str]]:
    """module -> modules of the same folder it imports (a package import counts as its
    __init__; `from pkg import mod` as mod)."""
    package = "backplan" if folder == "backplan" else f"backplan.{folder}"
    paths = sorted((root / folder).rglob("*.py"))
    modules = {}
    for path in paths:
        if folder == "backplan":
            parts = path.relative_to(root / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            modules[".".join(("backplan", *parts))] = path
        else:
            modules[module_name(folder, path, root)] = path
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        source = _without_type_checking_blocks(path.read_text(encoding="utf-8"))
        for _, target in imported_modules(source, module, path.name == "__init__.py"):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != module and target.startswith(package):
                if not _is_parent_package(target, module):
                    graph[module].add(target)
    return graph


def _without_type_checking_blocks(source: str) -> ast.Module:
    """`if TYPE_CHECKING:` imports never run; they name types for the reader and the checker.
    The tree, not its text again: unparsing and parsing every module took most of this test."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            node.body = [
                s for s in body if not (isinstance(s, ast.If) and _names_type_checking(s.test))
            ] or [ast.Pass()]
    return tree


def _names_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _is_parent_package(target: str, module: str) -> bool:
    """Importing a submodule runs its package's __init__ first; that edge is Python's, not ours."""
    return module.startswith(target + ".")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles_inside_a_folder():
    problems = [
        f"{folder}: {' <-> '.join(c)}" for folder in FOLDERS for c in cycles(import_graph(folder))
    ]
    assert not problems, "import cycles:\n" + "\n".join(problems)


def test_cycle_finder_finds_a_loop_hidden_by_a_lazy_import(tmp_path):
    (tmp_path / "ir").mkdir()
    (tmp_path / "ir" / "a.py").write_text("from .b import x\n")
    (tmp_path / "ir" / "b.py").write_text("def f():\n    from .c import y\n")
    (tmp_path / "ir" / "c.py").write_text("import backplan.ir.a\n")
    (tmp_path / "ir" / "d.py").write_text("from .a import z\n")
    found = cycles(import_graph("ir", tmp_path))
    assert found == [["backplan.ir.a", "backplan.ir.b", "backplan.ir.c"]]
