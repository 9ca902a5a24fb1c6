"""Pytrees: nested dicts, lists, tuples, namedtuples, dataclasses and registered classes of
leaves, flattened in a stable order. Public as `bp.tree`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from backplan.ir.errors import BackplanError

_CUSTOM: dict[type, tuple[Callable, Callable]] = {}


def register(
    cls: type,
    flatten_fn: Callable[[Any], tuple[Sequence[Any], Hashable]],
    unflatten_fn: Callable[[Any, Sequence[Any]], Any],
) -> type:
    """Make instances of cls pytree nodes. flatten_fn(obj) returns (children, aux): children
    a sequence of subtrees, aux hashable data that is not traced (a name, a flag);
    unflatten_fn(aux, children) rebuilds the object. As in JAX's register_pytree_node.

    >>> import backplan as bp
    >>> class Pair:
    ...     def __init__(self, a, b):
    ...         self.a, self.b = a, b
    >>> _ = bp.tree.register(Pair, lambda p: ((p.a, p.b), None), lambda aux, kids: Pair(*kids))
    >>> bp.tree.leaves(Pair(1, [2, 3]))
    [1, 2, 3]
    """
    if not isinstance(cls, type):
        raise TypeError(f"bp.tree.register needs a class, got {cls!r}")
    if cls in (tuple, list, dict, type(None)):
        raise TypeError(f"{cls.__name__} is already a pytree node")
    _CUSTOM[cls] = (flatten_fn, unflatten_fn)
    _KINDS.clear()  # cls, or a subclass of a type seen before, may have been a leaf until now
    _FIELDS.pop(cls, None)
    return cls


def static_field(**kwargs) -> Any:
    """A dataclass field that is part of the structure, not a leaf (a name, a flag, a size):
    compiled functions key on its value, value_and_grad and optimizers leave it alone. As
    equinox's `field(static=True)` and flax's `struct.field(pytree_node=False)`.

    >>> import dataclasses, backplan as bp
    >>> @dataclasses.dataclass
    ... class Layer:
    ...     w: bp.Tensor
    ...     name: str = bp.tree.static_field(default="dense")
    >>> bp.tree.leaves(Layer(1.0))
    [1.0]
    """
    metadata = {**kwargs.pop("metadata", {}), "static": True}
    return dataclasses.field(metadata=metadata, **kwargs)


_FIELDS: dict[type, tuple[tuple[str, ...], tuple[str, ...]]] = {}  # cls -> (data, static)


def _dataclass_fields(cls: type) -> tuple[tuple[str, ...], tuple[str, ...]]:
    fields = _FIELDS.get(cls)
    if fields is None:
        init = [f for f in dataclasses.fields(cls) if f.init]
        fields = _FIELDS[cls] = (
            tuple(f.name for f in init if not f.metadata.get("static")),
            tuple(f.name for f in init if f.metadata.get("static")),
        )
    return fields


@dataclass(frozen=True)
class TreeDef:
    kind: str  # "leaf", "none", "tuple", "list", "dict", "namedtuple", "dataclass", "custom"
    children: tuple = ()
    # dict keys, the namedtuple class, (class, field names, ((static field, value), ...)),
    # (class, aux)
    meta: object = None

    @property
    def num_leaves(self) -> int:
        if self.kind == "leaf":
            return 1
        return sum(c.num_leaves for c in self.children)


LEAF = TreeDef("leaf")


def flatten(tree: Any, paths: bool = False, prefix: str = "") -> Any:
    """Leaves in order and the structure; with paths=True also a readable path per leaf."""
    leaves: list = []
    if not paths:
        return leaves, _flatten(tree, leaves, None, prefix)
    names: list = []
    treedef = _flatten(tree, leaves, names, prefix)
    return leaves, treedef, names


_KINDS: dict[type, str] = {}  # type -> its node kind, worked out once (register clears it)


def _kind(cls: type) -> str:
    """What instances of cls are: a custom node, a dataclass, a namedtuple, a sequence, a dict
    or a leaf. Asked once per type: a parameter dict's tensors cost a lookup each, not the
    dataclass and namedtuple tests (optimizers and zero_grad flatten on every step)."""
    kind = _KINDS.get(cls)
    if kind is None:
        if cls in _CUSTOM:
            kind = "custom"
        elif dataclasses.is_dataclass(cls) and not issubclass(cls, type):
            kind = "dataclass"
        elif issubclass(cls, tuple) and hasattr(cls, "_fields"):
            kind = "namedtuple"
        elif issubclass(cls, tuple | list):
            kind = "sequence"
        elif issubclass(cls, dict):
            kind = "dict"
        else:
            kind = "leaf"
        _KINDS[cls] = kind
    return kind


def _flatten(tree, leaves: list, names: list | None, path: str) -> TreeDef:
    """names is None when no paths are wanted: then no path text is built."""
    if tree is None:
        return TreeDef("none")
    kind = _kind(type(tree))
    if kind == "leaf":
        leaves.append(tree)
        if names is not None:
            names.append(path or "<leaf>")
        return LEAF
    if kind == "dict":
        keys = tuple(tree)
        kids = tuple(
            [_flatten(tree[k], leaves, names, names is not None and f"{path}[{k!r}]") for k in keys]
        )
        return TreeDef("dict", kids, keys)
    if kind == "sequence":
        kids = tuple(
            [
                _flatten(v, leaves, names, names is not None and f"{path}[{i}]")
                for i, v in enumerate(tree)
            ]
        )
        return TreeDef(type(tree).__name__, kids)
    if kind == "custom":
        return _flatten_custom(tree, _CUSTOM[type(tree)][0], leaves, names, path)
    if kind == "dataclass":
        fields, static = _dataclass_fields(type(tree))
        kids = tuple(
            [
                _flatten(getattr(tree, f), leaves, names, names is not None and f"{path}.{f}")
                for f in fields
            ]
        )
        return TreeDef("dataclass", kids, (type(tree), fields, _static_values(tree, static, path)))
    kids = tuple(
        [
            _flatten(v, leaves, names, names is not None and f"{path}.{f}")
            for f, v in zip(tree._fields, tree, strict=True)
        ]
    )
    return TreeDef("namedtuple", kids, type(tree))


def _static_values(tree, static: tuple[str, ...], path) -> tuple:
    values = tuple((name, getattr(tree, name)) for name in static)
    for name, value in values:
        try:
            hash(value)
        except TypeError:
            raise BackplanError(
                f"static field {path or ''}.{name} of {type(tree).__name__} holds a "
                f"{type(value).__name__}, which is not hashable; a static field is part of the "
                "structure, so it must be hashable (a tuple for a list, a tuple of pairs or a "
                "frozenset for a dict or set)"
            ) from None
    return values


def _flatten_custom(tree, flatten_fn, leaves, names, path) -> TreeDef:
    children, aux = flatten_fn(tree)
    try:
        hash(aux)
    except TypeError:
        raise BackplanError(
            f"the flatten function registered for {type(tree).__name__} returned aux data "
            f"{aux!r} that is not hashable; return a tuple, string or number as aux"
        ) from None
    kids = tuple(
        [
            _flatten(v, leaves, names, names is not None and f"{path}[{i}]")
            for i, v in enumerate(children)
        ]
    )
    return TreeDef("custom", kids, (type(tree), aux))


def difference(a: TreeDef, b: TreeDef, path: str = "") -> str | None:
    """Where two structures first differ, in words ("['w']: 2 items against 1"), or None when
    they are the same: errors name the place, not just the leaf counts."""
    where = path or "the top"
    if a.kind != b.kind:
        return f"{where}: {_node_text(a)} against {_node_text(b)}"
    if a.kind == "dict" and a.meta != b.meta:
        only_a = [k for k in a.meta if k not in b.meta]
        only_b = [k for k in b.meta if k not in a.meta]
        if only_a or only_b:
            parts = [f"keys only the first has: {only_a}"] if only_a else []
            parts += [f"keys only the second has: {only_b}"] if only_b else []
            return f"{where}: {'; '.join(parts)}"
        return f"{where}: the same keys in another order ({list(a.meta)} against {list(b.meta)})"
    if a.kind == "dataclass" and a.meta[:2] == b.meta[:2] and a.meta != b.meta:
        return f"{where}: static fields {dict(a.meta[2])} against {dict(b.meta[2])}"
    if a.meta != b.meta:
        return f"{where}: {_node_text(a)} against {_node_text(b)}"
    if len(a.children) != len(b.children):
        return f"{where}: {len(a.children)} items against {len(b.children)}"
    keys = (
        a.meta
        if a.kind == "dict"
        else (a.meta[1] if a.kind == "dataclass" else getattr(a.meta, "_fields", None))
    )
    for i, (x, y) in enumerate(zip(a.children, b.children, strict=True)):
        step = f"[{keys[i]!r}]" if a.kind == "dict" else f".{keys[i]}" if keys else f"[{i}]"
        found = difference(x, y, path + step)
        if found:
            return found
    return None


def _count(leaves: int) -> str:
    return f"{leaves} leaf" if leaves == 1 else f"{leaves} leaves"


def _node_text(node: TreeDef) -> str:
    if node.kind in ("leaf", "none"):
        return "a leaf" if node.kind == "leaf" else "None"
    if node.kind in ("dataclass", "custom"):
        return f"a {node.meta[0].__name__}"
    if node.kind == "namedtuple":
        return f"a {node.meta.__name__}"
    return f"a {node.kind} of {len(node.children)}"


def unflatten(treedef: TreeDef, leaves: Iterable[Any]) -> Any:
    """Rebuild the structure treedef describes from leaves (in flattening order)."""
    leaves = list(leaves)
    if len(leaves) != treedef.num_leaves:
        raise ValueError(f"the structure has {treedef.num_leaves} leaves, got {len(leaves)}")
    return _unflatten(treedef, iter(leaves))


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
    if kind == "dataclass":
        cls, fields, static = treedef.meta
        return cls(**dict(zip(fields, kids, strict=True)), **dict(static))
    if kind == "custom":
        cls, aux = treedef.meta
        return _CUSTOM[cls][1](aux, kids)
    return treedef.meta(*kids)


def unflattener(treedef: TreeDef) -> Callable[[Sequence[Any]], Any]:
    """unflatten for one structure, worked out once: what a compiled function returns on every
    call is rebuilt without walking the TreeDef again.

    >>> build = unflattener(structure({"a": 0, "b": (0, 0)}))
    >>> build([1, 2, 3])
    {'a': 1, 'b': (2, 3)}
    """
    count, build = treedef.num_leaves, _builder(treedef)

    def rebuild(leaves: Sequence[Any]) -> Any:
        if len(leaves) != count:
            raise ValueError(f"the structure has {count} leaves, got {len(leaves)}")
        return build(iter(leaves))

    return rebuild


def _builder(treedef: TreeDef) -> Callable:
    """A function of an iterator over leaves that rebuilds treedef's containers."""
    kind = treedef.kind
    if kind == "leaf":
        return next
    if kind == "none":
        return lambda it: None
    kids = [_builder(c) for c in treedef.children]
    flat = all(c.kind == "leaf" for c in treedef.children)
    if kind == "dict":
        keys = treedef.meta
        if flat:  # zip takes a key first, so it stops before taking a leaf too many
            return lambda it: dict(zip(keys, it, strict=False))
        return lambda it: {k: b(it) for k, b in zip(keys, kids, strict=True)}
    if kind == "tuple":
        return lambda it: tuple([b(it) for b in kids])
    if kind == "list":
        return lambda it: [b(it) for b in kids]
    return lambda it: _unflatten(treedef, it)


def leaves(tree: Any) -> list[Any]:
    """The leaves of tree in flattening order (None is an empty node, not a leaf)."""
    found: list = []
    _collect(tree, found)
    return found


def _collect(tree, found: list) -> None:
    """flatten's walk without its TreeDefs: zero_grad and optimizers ask for leaves each step."""
    kind = "none" if tree is None else _kind(type(tree))
    if kind == "leaf":
        found.append(tree)
    elif kind == "dict":
        for value in tree.values():
            _collect(value, found)
    elif kind == "sequence":
        for value in tree:
            _collect(value, found)
    elif kind != "none":
        found.extend(flatten(tree)[0])  # dataclasses, namedtuples, registered classes


def structure(tree: Any) -> TreeDef:
    return flatten(tree)[1]


def tree_map(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """fn applied to every leaf; with more trees of the same structure, fn gets one leaf of
    each: `bp.tree.map(lambda p, g: p - 0.1 * g, params, grads)`."""
    leaves_, treedef = flatten(tree)
    others = []
    for other in rest:
        other_leaves, other_def = flatten(other)
        if other_def != treedef:
            raise ValueError(
                f"bp.tree.map needs trees of one structure; tree 1 and tree {len(others) + 2} "
                f"differ at {difference(treedef, other_def)} ({_count(treedef.num_leaves)} "
                f"against {_count(other_def.num_leaves)})"
            )
        others.append(other_leaves)
    return unflatten(treedef, [fn(*args) for args in zip(leaves_, *others, strict=True)])
