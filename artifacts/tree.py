"""Pytree structures, static values and call signatures as plain JSON, and back.

Only data is stored: namedtuples become tuples and dataclasses dicts of their fields (their
classes cannot be restored without the model's code), classes registered with
`bp.tree.register` cannot be stored, and static values must be ints, floats, strings or bools.
"""

from __future__ import annotations

import inspect

from backplan.tracer.pytree import TreeDef

from .format import ExportError

MAX_DEPTH = 64
MAX_STRING = 4096
PARAMETER_KINDS = {
    kind.name: kind
    for kind in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.VAR_POSITIONAL,
        inspect.Parameter.KEYWORD_ONLY,
        inspect.Parameter.VAR_KEYWORD,
    )
}


# ---- static values ----------------------------------------------------------------------------


def static_to_json(value, where: str) -> dict:
    """ints, floats (kept exact as repr text, so nan and inf survive), strings and bools."""
    if isinstance(value, bool):
        return {"type": "bool", "value": value}
    if type(value) is int:
        return {"type": "int", "value": value}
    if type(value) is float:
        return {"type": "float", "value": repr(value)}
    if type(value) is str and len(value) <= MAX_STRING:
        return {"type": "str", "value": value}
    raise ExportError(
        f"{where}: the static value {value!r} of type {type(value).__name__} cannot be stored in "
        "an artifact; only int, float, str and bool values can (pass arrays as tensors)"
    )


def static_from_json(obj, where: str):
    kind = obj.get("type") if isinstance(obj, dict) else None
    value = obj.get("value") if isinstance(obj, dict) else None
    if kind == "bool" and isinstance(value, bool):
        return value
    if kind == "int" and type(value) is int:
        return value
    if kind == "float" and isinstance(value, str) and len(value) < 64:
        try:
            return float(value)
        except ValueError:
            pass
    if kind == "str" and isinstance(value, str) and len(value) <= MAX_STRING:
        return value
    raise ExportError(f"{where}: bad static value {obj!r}")


def static_key(value) -> tuple[str, object]:
    """The same (type name, value) pair the signature cache keys static leaves by."""
    return (type(value).__name__, value)


# ---- pytree structure -------------------------------------------------------------------------


def treedef_to_json(treedef: TreeDef, where: str) -> dict:
    kids = [treedef_to_json(c, where) for c in treedef.children]
    if treedef.kind in ("leaf", "none"):
        return {"kind": treedef.kind}
    if treedef.kind in ("tuple", "list"):
        return {"kind": treedef.kind, "children": kids}
    if treedef.kind == "namedtuple":
        return {"kind": "tuple", "namedtuple": treedef.meta.__name__, "children": kids}
    if treedef.kind == "dict":
        keys = [static_to_json(k, f"{where}: dict key") for k in treedef.meta]
        return {"kind": "dict", "keys": keys, "children": kids}
    if treedef.kind == "dataclass":
        cls, fields, static = treedef.meta
        if static:
            raise ExportError(
                f"{where}: a {cls.__name__} with static fields ({', '.join(n for n, _ in static)}) "
                "cannot be stored in an artifact yet, because a loaded artifact could not check "
                "their values; make them ordinary fields or pass the data fields as a dict"
            )
        keys = [static_to_json(k, f"{where}: field") for k in fields]
        return {"kind": "dict", "dataclass": cls.__name__, "keys": keys, "children": kids}
    if treedef.kind == "custom":
        cls = treedef.meta[0]
        raise ExportError(
            f"{where}: a {cls.__name__} (registered with bp.tree.register) cannot be stored in "
            "an artifact, because loading it would need your code; pass its contents as a "
            "dict, tuple or dataclass instead"
        )
    raise ExportError(f"{where}: pytree node of kind {treedef.kind!r} cannot be stored")


def treedef_from_json(obj, where: str, depth: int = 0) -> TreeDef:
    if depth > MAX_DEPTH:
        raise ExportError(f"{where}: pytree nested deeper than {MAX_DEPTH} levels")
    kind = obj.get("kind") if isinstance(obj, dict) else None
    if kind in ("leaf", "none"):
        return TreeDef(kind)
    children = obj.get("children") if kind else None
    if kind not in ("tuple", "list", "dict") or not isinstance(children, list):
        raise ExportError(f"{where}: bad pytree node {str(obj)[:80]}")
    kids = tuple(treedef_from_json(c, where, depth + 1) for c in children)
    if kind != "dict":
        return TreeDef(kind, kids)
    raw_keys = obj.get("keys")
    if not isinstance(raw_keys, list) or len(raw_keys) != len(kids):
        raise ExportError(f"{where}: dict node needs one key per child")
    keys = tuple(static_from_json(k, f"{where}: dict key") for k in raw_keys)
    if len(set(keys)) != len(keys):
        raise ExportError(f"{where}: dict node repeats a key")
    return TreeDef("dict", kids, keys)


def leaf_paths(treedef: TreeDef, prefix: str = "") -> list[str]:
    """Readable paths (`params['w0']`, `args[1]`) of the leaves, in flattening order."""
    if treedef.kind == "leaf":
        return [prefix or "<leaf>"]
    if treedef.kind == "none":
        return []
    paths = []
    for i, child in enumerate(treedef.children):
        key = _child_key(treedef, i)
        paths.extend(leaf_paths(child, child_path(prefix, key)))
    return paths


def dotted_leaf_names(treedef: TreeDef, prefix: str = "") -> list[str]:
    """state_dict-style names (`layer1.0.weight`) of the leaves, in flattening order: the
    names a flat checkpoint format (safetensors) stores its tensors under."""
    if treedef.kind == "leaf":
        return [prefix]
    names = []
    for i, child in enumerate(treedef.children):
        key = str(_child_key(treedef, i))
        names.extend(dotted_leaf_names(child, f"{prefix}.{key}" if prefix else key))
    return names


def _child_key(treedef: TreeDef, i: int):
    if treedef.kind == "dict":
        return treedef.meta[i]
    if treedef.kind == "dataclass":
        return treedef.meta[1][i]
    return i


def child_path(path: str, key) -> str:
    """`params['w0']`, `args[1]`: top-level names bare, the rest as subscripts."""
    return key if not path and isinstance(key, str) else f"{path}[{key!r}]"


# ---- call signatures --------------------------------------------------------------------------


def parameters_to_json(signature: inspect.Signature) -> list[dict]:
    """Names, kinds and defaults; a default that is not a plain static value is dropped, so the
    loaded function needs that argument passed explicitly."""
    params = []
    for p in signature.parameters.values():
        entry = {"name": p.name, "kind": p.kind.name}
        if p.default is None:
            entry["default"] = {"type": "none"}
        elif p.default is not inspect.Parameter.empty:
            try:
                entry["default"] = static_to_json(p.default, p.name)
            except ExportError:
                pass
        params.append(entry)
    return params


def signature_from_json(params, where: str) -> inspect.Signature:
    if not isinstance(params, list):
        raise ExportError(f"{where}: parameters must be a list")
    built = []
    for entry in params:
        name = entry.get("name") if isinstance(entry, dict) else None
        kind = PARAMETER_KINDS.get(entry.get("kind")) if isinstance(entry, dict) else None
        if not isinstance(name, str) or not name.isidentifier() or kind is None:
            raise ExportError(f"{where}: bad parameter {str(entry)[:80]}")
        default = inspect.Parameter.empty
        if "default" in entry:
            raw = entry["default"]
            none = isinstance(raw, dict) and raw.get("type") == "none"
            default = None if none else static_from_json(raw, f"{where}: default of {name}")
        built.append(inspect.Parameter(name, kind, default=default))
    try:
        return inspect.Signature(built)
    except (ValueError, TypeError) as exc:
        raise ExportError(f"{where}: parameters do not form a valid signature: {exc}") from None


def render_tree(treedef: TreeDef, leaf_texts) -> str:
    """A pytree drawn with each leaf replaced by its text, e.g. `{'w0': f32[32,64], 'b0': ...}`."""
    texts = iter(leaf_texts)
    return _render(treedef, texts)


def _render(treedef: TreeDef, texts) -> str:
    if treedef.kind == "leaf":
        return next(texts)
    if treedef.kind == "none":
        return "None"
    kids = [_render(c, texts) for c in treedef.children]
    if treedef.kind == "dict":
        return "{" + ", ".join(f"{k!r}: {v}" for k, v in zip(treedef.meta, kids, strict=True)) + "}"
    if treedef.kind == "dataclass":
        cls, fields = treedef.meta[:2]
        pairs = zip(fields, kids, strict=True)
        return f"{cls.__name__}(" + ", ".join(f"{k}={v}" for k, v in pairs) + ")"
    if treedef.kind == "list":
        return "[" + ", ".join(kids) + "]"
    return "(" + ", ".join(kids) + ("," if len(kids) == 1 else "") + ")"
