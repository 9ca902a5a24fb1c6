"""Reading meta.json's parts: typed fields, dtypes, shapes within the size limit, the exported
signature (argument structure plus one key per leaf), and the plan inputs it implies."""

from __future__ import annotations

from backplan.ir.errors import BackplanError
from backplan.ir.shapes import check_size
from backplan.ir.types import DTYPES, TensorType, dtype_name
from backplan.tracer.signature import LeafKey, SignatureKey

from .format import ExportError
from .tree import static_from_json, static_key, treedef_from_json

MAX_NAME = 200


def field(obj, name: str, kind: type, where: str):
    """obj[name] if it is of kind (bools are not ints here), else an ExportError naming it."""
    value = obj.get(name) if isinstance(obj, dict) else None
    if kind is int:
        ok = type(value) is int
    elif kind is bool:
        ok = isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise ExportError(f"{where}: field {name!r} is missing or not a {kind.__name__}")
    return value


def check_shape(raw, where: str) -> tuple[int, ...]:
    if not isinstance(raw, list) or len(raw) > 64 or any(type(d) is not int or d < 0 for d in raw):
        raise ExportError(f"{where}: bad shape {str(raw)[:80]}")
    shape = tuple(raw)
    try:
        check_size(shape)
    except BackplanError as exc:
        raise ExportError(f"{where}: {exc}") from None
    return shape


def check_dtype(raw, where: str) -> str:
    if raw not in DTYPES:
        raise ExportError(f"{where}: bad dtype {raw!r}")
    return raw


def signature_key(arguments: dict) -> SignatureKey:
    treedef = treedef_from_json(arguments.get("tree"), "meta.json arguments")
    if treedef.kind != "dict":
        raise ExportError("meta.json: the arguments must be a dict of parameters")
    raw = field(arguments, "leaves", list, "meta.json arguments")
    if len(raw) != treedef.num_leaves:
        raise ExportError(
            f"meta.json: {len(raw)} argument leaves for a structure with {treedef.num_leaves}"
        )
    return SignatureKey(treedef, tuple(_leaf_key(entry) for entry in raw))


def _leaf_key(entry) -> LeafKey:
    path = field(entry, "path", str, "meta.json argument")[:MAX_NAME]
    where = f"meta.json argument {path}"
    if entry.get("kind") == "tensor":
        return LeafKey(
            path,
            "tensor",
            check_shape(entry.get("shape"), where),
            check_dtype(entry.get("dtype"), where),
            field(entry, "requires_grad", bool, where),
            weak=_float_flag(entry, where),
        )
    if entry.get("kind") == "static":
        return LeafKey(
            path, "static", static=static_key(static_from_json(entry.get("value"), where))
        )
    raise ExportError(f"{where}: leaf kind must be tensor or static")


def _float_flag(entry: dict, where: str) -> bool:
    """True for a Python float argument (a weakly typed f64[] input); absent in older files."""
    flag = entry.get("float", False)
    if not isinstance(flag, bool):
        raise ExportError(f"{where}: 'float' must be true or false")
    if flag and (entry.get("dtype") != "f64" or entry.get("shape") != []):
        raise ExportError(f"{where}: a float argument must be f64[]")
    return flag


def check_inputs(graph, key: SignatureKey, captured: list, where: str) -> None:
    expected = [TensorType(k.dtype, k.shape) for k in key.leaves if k.kind == "tensor"]
    expected += [TensorType(dtype_name(a.dtype), a.shape) for a in captured]
    found = [v.type for v in graph.inputs]
    if found != expected or any(v.role != "arg" for v in graph.inputs):
        raise ExportError(
            f"{where}: the plan's inputs {[str(t) for t in found]} do not match the "
            f"signature and captured arrays {[str(t) for t in expected]}"
        )


def bool_list(raw, length: int, where: str) -> list[bool]:
    if not isinstance(raw, list) or len(raw) != length or any(not isinstance(b, bool) for b in raw):
        raise ExportError(f"{where}: expected {length} true/false flags")
    return raw
