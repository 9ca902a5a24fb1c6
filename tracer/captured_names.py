"""Names for the tensors a traced function captured from outside its arguments, as the user's
code calls them: `w (captured)` for a closure or global `w`, `params['w0'] (captured)` for a
tensor inside a global dict. Tensors reached only through other functions stay `captured[i]`."""

from __future__ import annotations

from .pytree import flatten
from .tensor import Tensor

MAX_CONTAINER = 1000  # larger globals are data, not parameters: not searched


def captured_names(fn, captured: list) -> list[str]:
    paths = _tensor_paths(_visible_names(fn))
    return [
        f"{paths[id(t)]} (captured)" if id(t) in paths else f"captured[{i}]"
        for i, t in enumerate(captured)
    ]


def _visible_names(fn) -> dict:
    """Closure variables and the globals fn's own code names."""
    fn = getattr(fn, "__wrapped__", fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return {}
    names = {}
    global_scope = getattr(fn, "__globals__", {})
    for name in code.co_names:
        if name in global_scope:
            names[name] = global_scope[name]
    for name, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or (), strict=False):
        try:
            names[name] = cell.cell_contents
        except ValueError:  # a cell not filled yet
            continue
    return names


def _tensor_paths(scope: dict) -> dict[int, str]:
    paths: dict[int, str] = {}
    for name, value in scope.items():
        if isinstance(value, Tensor):
            paths.setdefault(id(value), name)
        elif isinstance(value, dict | list | tuple) and len(value) <= MAX_CONTAINER:
            leaves, _, leaf_paths = flatten(value, paths=True, prefix=name)
            for leaf, path in zip(leaves, leaf_paths, strict=True):
                if isinstance(leaf, Tensor):
                    paths.setdefault(id(leaf), path)
    return paths
