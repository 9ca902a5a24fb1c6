"""Imports point down: ir imports nothing of ours, codegen only ir, runtime ir and codegen,
report (explain) those three, tracer ir, runtime and report, artifacts (export/load) everything
below it, optim (optimizers) ir, runtime and tracer, and no layer imports the face
(`backplan` itself or its own modules).
Imports are read with ast, so lazy imports inside functions count too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ALLOWED = {
    "ir": set(),
    "codegen": {"ir"},
    "runtime": {"ir", "codegen"},
    "report": {"ir", "codegen", "runtime"},
    "tracer": {"ir", "runtime", "report"},
    "artifacts": {"ir", "codegen", "runtime", "report", "tracer"},
    "optim": {"ir", "runtime", "tracer"},
    "distributed": {"ir", "codegen", "runtime", "report", "tracer", "artifacts"},
    "interop": {"ir", "codegen", "runtime", "report", "tracer", "artifacts", "optim"},
}
DYNAMIC_IMPORTERS = ("import_module", "__import__")


def module_name(layer: str, path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root / layer).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("backplan", layer, *parts))


def imported_modules(source: str | ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module name) for every import statement and every
    importlib.import_module / __import__ call with a literal name (source: text, or its tree)."""
    found = []
    tree = ast.parse(source) if isinstance(source, str) else source
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found += [(node.lineno, name) for name in _from_targets(node, module, is_package)]
        elif isinstance(node, ast.Call) and _called_name(node) in DYNAMIC_IMPORTERS:
            if node.args and isinstance(node.args[0], ast.Constant):
                found.append((node.lineno, str(node.args[0].value)))
    return found


def _from_targets(node: ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    if node.level == 0:
        base = node.module or ""
    else:
        package = module.split(".") if is_package else module.split(".")[:-1]
        keep = len(package) - (node.level - 1)
        base = ".".join(package[: max(keep, 0)] + ([node.module] if node.module else []))
    if node.module and node.level == 0 and base != "backplan":
        return [base]
    # `from backplan import ir` or `from .. import x`: each name may be a module
    return [f"{base}.{alias.name}" if base else alias.name for alias in node.names]


def _called_name(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def violation(layer: str, target: str) -> str | None:
    """Why importing target from layer breaks the layering, or None."""
    parts = target.split(".")
    if parts[0] in ALLOWED:
        return f"imports {target!r} as a top-level module; import it as 'backplan.{target}'"
    if parts[0] != "backplan":
        return None  # the standard library or a third-party package
    if len(parts) == 1 or parts[1] not in ALLOWED:
        return f"imports the public face {target!r}"
    if parts[1] != layer and parts[1] not in ALLOWED[layer]:
        return f"imports the higher layer {target!r}"
    return None


def layer_violations(root: Path = ROOT) -> list[str]:
    problems = []
    for layer in ALLOWED:
        for path in sorted((root / layer).rglob("*.py")):
            module = module_name(layer, path, root)
            source = path.read_text(encoding="utf-8")
            for line, target in imported_modules(source, module, path.name == "__init__.py"):
                why = violation(layer, target)
                if why:
                    problems.append(f"{path.relative_to(root)}:{line} ({layer}) {why}")
    return problems


def test_layers_import_only_lower_layers():
    problems = layer_violations()
    assert not problems, "layering broken:\n" + "\n".join(problems)


def test_every_layer_has_source_files():
    for layer in ALLOWED:
        assert list((ROOT / layer).rglob("*.py")), f"no sources found under {layer}/"


# ---- the checker itself -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "layer,source,module,expected",
    [
        ("ir", "import backplan", "backplan.ir.graph", "backplan"),
        ("ir", "from backplan import Tensor", "backplan.ir.graph", "backplan.Tensor"),
        ("ir", "from backplan.runtime import engine", "backplan.ir.graph", "backplan.runtime"),
        ("ir", "from ..runtime import engine", "backplan.ir.graph", "backplan.runtime.engine"),
        ("ir", "from ... import tracer", "backplan.ir.ops.nn", "backplan.tracer"),
        ("ir", "from ... import demo", "backplan.ir.ops.nn", "backplan.demo"),
        (
            "codegen",
            "def f():\n    import backplan.tracer.ops",
            "backplan.codegen.x",
            "backplan.tracer.ops",
        ),
        (
            "codegen",
            "from backplan.runtime.region import Region",
            "backplan.codegen.x",
            "backplan.runtime.region",
        ),
        (
            "runtime",
            "import importlib\nimportlib.import_module('backplan.tracer')",
            "backplan.runtime.x",
            "backplan.tracer",
        ),
        (
            "runtime",
            "from backplan.__main__ import main",
            "backplan.runtime.x",
            "backplan.__main__",
        ),
        ("tracer", "from backplan.codegen import kernels", "backplan.tracer.x", "backplan.codegen"),
        ("tracer", "import ir.graph", "backplan.tracer.x", "ir.graph"),
    ],
)
def test_checker_finds_each_kind_of_violation(layer, source, module, expected):
    targets = [t for _, t in imported_modules(source, module, is_package=False)]
    assert expected in targets
    assert violation(layer, expected) is not None


@pytest.mark.parametrize(
    "layer,source,module",
    [
        ("ir", "from .graph import Graph\nimport numpy as np", "backplan.ir.text"),
        ("ir", "from . import ops", "backplan.ir.registry"),
        ("ir", "from . import creation, elementwise", "backplan.ir.ops"),
        ("ir", "from ..errors import DtypeError", "backplan.ir.ops.common"),
        ("codegen", "from backplan.ir.graph import Graph", "backplan.codegen.render.emit"),
        (
            "runtime",
            "from backplan.codegen import x\nfrom backplan.ir import y",
            "backplan.runtime.z",
        ),
        (
            "tracer",
            "from backplan.runtime import engine\nimport backplan.ir.types",
            "backplan.tracer.t",
        ),
    ],
)
def test_checker_accepts_downward_imports(layer, source, module):
    is_package = module == "backplan.ir.ops"
    for _, target in imported_modules(source, module, is_package):
        assert violation(layer, target) is None, target


def test_checker_reports_file_and_line(tmp_path):
    (tmp_path / "ir").mkdir()
    for layer in ("codegen", "runtime", "tracer"):
        (tmp_path / layer).mkdir()
    (tmp_path / "ir" / "bad.py").write_text("import os\n\nfrom backplan.tracer import ops\n")
    problems = layer_violations(tmp_path)
    assert len(problems) == 1
    assert problems[0].startswith("ir/bad.py:3 (ir) imports the higher layer 'backplan.tracer")


LAYERS = ("ir", "codegen", "runtime", "tracer", "report", "artifacts")


def internal_imports(path: Path, root: Path = ROOT) -> list[str]:
    """`file:line module` for each import of a layer's module (backplan.ir, ...) in path."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "backplan" and len(parts) > 1 and parts[1] in LAYERS:
                found.append(f"{path.relative_to(root)}:{node.lineno} {name}")
    return found


def test_bench_reaches_internals_through_one_module():
    """The harness uses the public API; the internals it times or compares with are named in
    bench/internals.py alone, so a refactor of the layers touches one file of bench/."""
    files = [p for p in (ROOT / "bench").rglob("*.py") if p.name != "internals.py"]
    assert files
    assert [hit for path in files for hit in internal_imports(path)] == []


def test_internal_imports_finds_a_layer_import(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import os\nfrom backplan.codegen.build import cache\nimport backplan\n")
    assert internal_imports(sample, tmp_path) == ["sample.py:2 backplan.codegen.build"]
