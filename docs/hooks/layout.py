"""MkDocs hook: give mkdocstrings the package as it installs.

backplan's sub-packages live beside `backplan/` in the repository (`tracer/` installs as
`backplan.tracer`, as pyproject.toml's package-dir says), so static analysis cannot find
`backplan.tracer` under `backplan/`. This hook builds a temporary folder of symbolic links in the
installed shape and puts it first on the Python handler's search path; nothing is imported.
`backplan/`'s own files are copied, not linked: griffe resolves a linked `__init__.py` to the
repository and would look for the sub-packages there again.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
import tomllib
from pathlib import Path

from mkdocs.plugins import event_priority

ROOT = Path(__file__).resolve().parents[2]


def installed_layout(root: Path, into: Path) -> Path:
    """Copies `backplan/` to `into/backplan` and links each mapped sub-package into it."""
    package = into / "backplan"
    shutil.copytree(root / "backplan", package, ignore=shutil.ignore_patterns("__pycache__"))
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    for name, folder in pyproject["tool"]["setuptools"]["package-dir"].items():
        parts = name.split(".")
        if len(parts) == 2 and not (package / parts[1]).exists():
            (package / parts[1]).symlink_to(root / folder)
    return into


@event_priority(100)  # before mkdocstrings reads its handler options
def on_config(config):
    into = Path(tempfile.mkdtemp(prefix="backplan-docs-"))
    atexit.register(shutil.rmtree, into, ignore_errors=True)
    python = config.plugins["mkdocstrings"].config.handlers.setdefault("python", {})
    python["paths"] = [str(installed_layout(ROOT, into))]
    return config
