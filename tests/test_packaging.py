"""Packaging: typed public API checked by mypy, the command line's --version, description and
cache command, and the metadata in pyproject.toml."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import backplan as bp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TYPING = os.path.join(ROOT, "tests", "typing")


def _pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _installed_layout(tmp_path) -> str:
    """The package as installed (backplan.tracer from tracer/, ...), made of symlinks, so mypy
    sees what a user's site-packages holds without an install."""
    site = tmp_path / "site"
    package_dirs = _pyproject()["tool"]["setuptools"]["package-dir"]
    for package, folder in sorted(package_dirs.items(), key=lambda kv: kv[0].count(".")):
        target = site.joinpath(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        source = os.path.join(ROOT, folder)
        for name in os.listdir(source):
            if name.endswith(".py") or name == "py.typed":
                (target / name).symlink_to(os.path.join(source, name))
    return str(site)


def _mypy(site: str, file_name: str) -> subprocess.CompletedProcess:
    pytest.importorskip("mypy")
    env = {**os.environ, "MYPYPATH": site}
    args = ["--follow-imports=silent", "--no-incremental", "--python-version=3.11"]
    return subprocess.run(
        [sys.executable, "-m", "mypy", *args, os.path.join(TYPING, file_name)],
        capture_output=True,
        text=True,
        env=env,
        cwd=os.path.dirname(site),
        timeout=300,
    )


def test_py_typed_marker_is_package_data():
    assert os.path.exists(os.path.join(ROOT, "backplan", "py.typed"))
    assert "py.typed" in _pyproject()["tool"]["setuptools"]["package-data"]["backplan"]


def test_typed_example_passes_mypy_and_mistakes_are_caught(tmp_path):
    site = _installed_layout(tmp_path)
    good = _mypy(site, "typed_example.py")
    assert good.returncode == 0, good.stdout + good.stderr
    bad = _mypy(site, "typed_mistakes.py")
    lines = [line for line in bad.stdout.splitlines() if ": error:" in line]
    found = {int(line.split(":")[1]) for line in lines}
    assert found == {6, 7, 8, 9, 10}, bad.stdout  # one error per wrong line, none elsewhere


def _cli(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "backplan", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


def test_version_and_description():
    result = _cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"backplan {bp.__version__}"
    assert bp.__version__ == _pyproject()["project"]["version"]
    help_text = " ".join(_cli("--help").stdout.split())
    assert "static forward and backward plans" in help_text
    assert "cache" in help_text


def test_cache_info_and_clear_touch_only_backplan_files(tmp_path):
    cache = tmp_path / "kernels"
    (cache / "__pycache__").mkdir(parents=True)
    (cache / "bp_abc.py").write_text("x = 1\n")
    (cache / "bp_abc.json").write_text("{}")
    (cache / "k_def.py").write_text("y = 2\n")  # a loop kernel plans share: not a plan
    (cache / "__pycache__" / "bp_abc.run-1.py311.nbi").write_bytes(b"0" * 100)
    (cache / "notes.txt").write_text("mine")
    # the library's own folder apart too: the suite shares one, which `clear` would empty
    env = {"BACKPLAN_CACHE_DIR": str(cache), "BACKPLAN_LIBRARY_CACHE_DIR": str(tmp_path / "lib")}
    info = _cli("cache", "info", env=env)
    assert info.returncode == 0, info.stderr
    assert str(cache) in info.stdout
    assert "entries: 1 compiled plan, 1 shared loop kernel (4 files)" in info.stdout
    assert "size: 114 B" in info.stdout
    cleared = _cli("cache", "clear", env=env)
    assert (
        cleared.returncode == 0
        and "removed 1 compiled plan, 1 shared loop kernel" in cleared.stdout
    )
    assert sorted(os.listdir(cache)) == ["__pycache__", "notes.txt"]
    assert os.listdir(cache / "__pycache__") == []


def test_project_metadata():
    project = _pyproject()["project"]
    assert project["license"] == {"text": "MIT"}
    assert project["authors"] == [{"name": "backplan developers"}]
    assert "Typing :: Typed" in project["classifiers"]
    assert any(dep.startswith("mypy") for dep in project["optional-dependencies"]["test"])
    assert os.path.exists(os.path.join(ROOT, "LICENSE"))


def test_every_source_folder_is_a_listed_package():
    """A wheel holds only the listed packages: a folder of modules left out of pyproject.toml's
    `packages` (codegen's rooms were, once) works in an editable install and is missing from
    every installed copy."""
    tool = _pyproject()["tool"]["setuptools"]
    listed = set(tool["packages"])
    for package, folder in tool["package-dir"].items():
        for init in sorted(Path(ROOT, folder).rglob("*.py")):
            parts = init.parent.relative_to(Path(ROOT, folder)).parts
            if "__pycache__" in parts:
                continue
            name = ".".join((package, *parts))
            assert name in listed, f"{init.parent} holds modules but {name} is not in packages"
            assert init.parent.joinpath("__init__.py").exists(), f"{init.parent} has no __init__.py"


def test_names_the_face_imports_lazily_resolve():
    """bp.from_torch imports torch on first use: without torch it says what to install (an
    AttributeError would read as a name backplan lacks); with torch it is the function."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        with pytest.raises(ImportError, match=r"pip install 'backplan\[torch\]'"):
            bp.from_torch  # noqa: B018
    else:
        assert bp.from_torch.__name__ == "from_torch"
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        bp.no_such_name  # noqa: B018


def test_no_source_file_is_ignored_by_git():
    """A new module that .gitignore hides stays in its author's folder and never reaches main
    (`build/` once ignored codegen/build/, and main imported a module it did not have)."""
    import shutil

    if shutil.which("git") is None or not os.path.exists(os.path.join(ROOT, ".git")):
        pytest.skip("needs git and a checkout")
    folders = _pyproject()["tool"]["setuptools"]["package-dir"].values()
    sources = sorted(
        str(path.relative_to(ROOT))
        for folder in set(folders)
        for path in Path(ROOT, folder).rglob("*.py")
        if "__pycache__" not in path.parts
    )
    ignored = subprocess.run(
        ["git", "check-ignore", "--no-index", "--stdin"],
        input="\n".join(sources),
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert not ignored, f".gitignore hides source files: {ignored}"


def test_the_build_needs_only_a_setuptools_that_builds_wheels_itself():
    """`pip install --no-build-isolation -e .` builds with the environment's own tools (pip's
    `--check-build-dependencies` checks them against these requirements). setuptools builds
    wheels itself from 70.1; an older one needs the wheel package ("invalid command
    'bdist_wheel'", as in a venv Python 3.11 made, which holds setuptools 65.5). So the
    requirements admit no setuptools without bdist_wheel and name nothing else: an environment
    with setuptools 84 and no wheel package builds."""
    from packaging.requirements import Requirement

    requires = [Requirement(r) for r in _pyproject()["build-system"]["requires"]]
    assert [r.name for r in requires] == ["setuptools"], requires
    (setuptools,) = requires
    assert not setuptools.specifier.contains("70.0.0") and not setuptools.specifier.contains("65.5")
    assert setuptools.specifier.contains("70.1.0") and setuptools.specifier.contains("84.2.1")
