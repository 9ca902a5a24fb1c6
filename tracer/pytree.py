"""Pytrees: nested dicts, lists, tuples (and namedtuples) of leaves, flattened in a stable order."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TreeDef:
    kind: str  # "leaf", "none", "tuple", "list", "dict", "namedtuple"
    children: tuple = ()
    meta: object = None  # dict keys, or the namedtuple class

    @property
    def num_leaves(self) -> int:
        if self.kind == "leaf":
            return 1
        return sum(c.num_leaves for c in self.children)


LEAF = TreeDef("leaf")


def flatten(tree, paths: bool = False, prefix: str = ""):
    """Leaves in order and the structure; with paths=True also a readable path per leaf."""
    leaves, names = [], []
    treedef = _flatten(tree, leaves, names, prefix)
    return (leaves, treedef, names) if paths else (leaves, treedef)


def _flatten(tree, leaves, names, path) -> TreeDef:
    if tree is None:
        return TreeDef("none")
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        kids = tuple(
            _flatten(v, leaves, names, f"{path}.{f}")
            for f, v in zip(tree._fields, tree, strict=True)
        )
        return TreeDef("namedtuple", kids, type(tree))
    if isinstance(tree, tuple | list):
        kids = tuple(_flatten(v, leaves, names, f"{path}[{i}]") for i, v in enumerate(tree))
        return TreeDef(type(tree).__name__, kids)
    if isinstance(tree, dict):
        keys = tuple(tree)
        kids = tuple(_flatten(tree[k], leaves, names, f"{path}[{k!r}]") for k in keys)
        return TreeDef("dict", kids, keys)
    leaves.append(tree)
    names.append(path or "<leaf>")
    return LEAF


def unflatten(treedef: TreeDef, leaves):
    it = iter(leaves)
    result = _unflatten(treedef, it)
    return result


def _unflatten(treedef: TreeDef, it):
    kind = treedef.kind
    if kind == "leaf":
        return next(it)
    if kind == "none":
        return None
    kids = [_unflatten(c, it) for c in treedef.children]
    if kind == "tuple":
        return tuple(kids)
    if kind == "list":
        return kids
    if kind == "dict":
        return dict(zip(treedef.meta, kids, strict=True))
    return treedef.meta(*kids)


def tree_map(fn, tree):
    leaves, treedef = flatten(tree)
    return unflatten(treedef, [fn(leaf) for leaf in leaves])
