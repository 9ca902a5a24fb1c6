"""bp.load: read an artifact, check everything, and rebuild runnable plans from the IR text.

Checks, in order: the zip and its member names, the manifest (format, version, SHA-256 and
size of every member), the metadata's structure, every array's header (dtype, shape, no
pickles), every plan (parsed against the op registry, liveness recomputed, verifier), and how
the plans fit together and with the signature. Any failure is an ExportError at load time.
"""

from __future__ import annotations

import os
import re
from dataclasses import replace

from backplan.ir.errors import BackplanError
from backplan.ir.pipeline import PassLog, RegionPlans, SavedSlot
from backplan.ir.shapes import check_size
from backplan.ir.types import DTYPES, TensorType, dtype_name, is_float
from backplan.runtime import RegionProgram

from .artifact_format import ExportError, npy_to_array, parse_json, parse_text, read_artifact
from .artifact_plans import machine_memory_bytes, read_plan
from .artifact_tree import signature_from_json, static_from_json, static_key, treedef_from_json
from .compile import TracedFunction
from .functional import JointTrace
from .loaded import LoadedFunction, LoadedValueAndGrad
from .signature import LeafKey, SignatureKey
from .tensor import Tensor

PLAN_ROLES = {"compiled": ({"forward"}, {"forward", "backward"}), "value_and_grad": ({"joint"},)}
MAX_NAME = 200


def load(path, max_bytes: int | None = None):
    """Load an artifact written by bp.export: a callable with the exported signature (and
    explain()), needing none of the model's source. Nothing in the file is unpickled or run.
    max_bytes caps a plan's peak memory (default: this machine's physical memory).

    >>> import backplan as bp
    >>> bp.load("no/such/file.bpz")
    Traceback (most recent call last):
    ...
    backplan.tracer.artifact_format.ExportError: no/such/file.bpz: no such artifact file
    """
    where = os.fspath(path)
    manifest, members = read_artifact(where)
    reader = _MemberReader(members)
    try:
        loaded = _build(where, manifest, reader, max_bytes or machine_memory_bytes())
        reader.check_all_used()
        return loaded
    except ExportError as exc:
        raise ExportError(f"{where}: {exc}") from None
    except BackplanError as exc:
        raise ExportError(f"{where}: {type(exc).__name__}: {exc}") from None
    except (KeyError, TypeError, IndexError, AttributeError, ValueError) as exc:
        raise ExportError(
            f"{where}: malformed artifact metadata ({type(exc).__name__}: {exc})"
        ) from None


class _MemberReader:
    """Hands out members by name and remembers which were used: unused ones are refused."""

    def __init__(self, members: dict[str, bytes]):
        self.members = members
        self.used: set[str] = set()

    def get(self, name) -> bytes:
        if not isinstance(name, str) or name not in self.members:
            raise ExportError(f"meta.json refers to member {name!r}, which is not in the artifact")
        self.used.add(name)
        return self.members[name]

    def check_all_used(self) -> None:
        unused = sorted(set(self.members) - self.used)
        if unused:
            raise ExportError(f"members {unused} are listed but not used by meta.json")


def _build(where: str, manifest: dict, reader: _MemberReader, max_bytes: int):
    meta = parse_json(reader.get("meta.json"), "meta.json")
    kind = _field(meta, "kind", str, "meta.json")
    if kind not in PLAN_ROLES:
        raise ExportError(f"meta.json: unknown artifact kind {kind!r}")
    name = _field(meta, "name", str, "meta.json")
    if not name.isprintable() or len(name) > MAX_NAME:
        raise ExportError("meta.json: the function name is not a short printable string")
    key = _signature_key(_field(meta, "arguments", dict, "meta.json"))
    captured = [_read_array(reader, entry, f"captured[{i}]")
                for i, entry in enumerate(_field(meta, "captured", list, "meta.json"))]
    plans = _read_plans(reader, _field(meta, "plans", dict, "meta.json"), kind, max_bytes)
    common = {
        "path": where, "manifest": manifest, "members": reader.members, "name": name,
        "signature": signature_from_json(meta.get("parameters"), "meta.json parameters"),
        "key": key,
    }
    if set(common["signature"].parameters) != set(key.treedef.meta or ()):
        raise ExportError("meta.json: the parameters do not match the argument structure")
    if kind == "compiled":
        return _build_compiled(meta, key, captured, plans, common)
    return _build_joint(meta, key, captured, plans, common)


def _field(obj, name: str, kind: type, where: str):
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


def _shape(raw, where: str) -> tuple[int, ...]:
    if not isinstance(raw, list) or len(raw) > 64 or any(
            type(d) is not int or d < 0 for d in raw):
        raise ExportError(f"{where}: bad shape {str(raw)[:80]}")
    shape = tuple(raw)
    try:
        check_size(shape)
    except BackplanError as exc:
        raise ExportError(f"{where}: {exc}") from None
    return shape


def _dtype(raw, where: str) -> str:
    if raw not in DTYPES:
        raise ExportError(f"{where}: bad dtype {raw!r}")
    return raw


def _signature_key(arguments: dict) -> SignatureKey:
    treedef = treedef_from_json(arguments.get("tree"), "meta.json arguments")
    if treedef.kind != "dict":
        raise ExportError("meta.json: the arguments must be a dict of parameters")
    raw = _field(arguments, "leaves", list, "meta.json arguments")
    if len(raw) != treedef.num_leaves:
        raise ExportError(f"meta.json: {len(raw)} argument leaves for a structure with "
                          f"{treedef.num_leaves}")
    return SignatureKey(treedef, tuple(_leaf_key(entry) for entry in raw))


def _leaf_key(entry) -> LeafKey:
    path = _field(entry, "path", str, "meta.json argument")[:MAX_NAME]
    where = f"meta.json argument {path}"
    if entry.get("kind") == "tensor":
        return LeafKey(path, "tensor", _shape(entry.get("shape"), where),
                       _dtype(entry.get("dtype"), where),
                       _field(entry, "requires_grad", bool, where))
    if entry.get("kind") == "static":
        return LeafKey(path, "static", static=static_key(static_from_json(entry.get("value"),
                                                                          where)))
    raise ExportError(f"{where}: leaf kind must be tensor or static")


def _read_array(reader: _MemberReader, entry, where: str):
    dtype = _dtype(entry.get("dtype") if isinstance(entry, dict) else None, where)
    shape = _shape(entry.get("shape"), where)
    member = entry.get("member")
    return npy_to_array(reader.get(member), member, dtype, shape)


def _read_plans(reader: _MemberReader, raw: dict, kind: str, max_bytes: int) -> dict:
    if set(raw) not in PLAN_ROLES[kind]:
        raise ExportError(f"meta.json: a {kind} artifact cannot hold plans {sorted(raw)}")
    plans = {}
    for role, entry in raw.items():
        where = f"plan {role}"
        constants = {
            str(cname)[:MAX_NAME]: _read_array(reader, centry, f"{where} constant {cname}")
            for cname, centry in _field(entry, "constants", dict, where).items()
        }
        text = parse_text(reader.get(entry.get("ir")), entry.get("ir"))
        facts = parse_json(reader.get(entry.get("facts")), entry.get("facts"))
        plans[role] = read_plan(text, facts, constants, entry.get("ir"), max_bytes)
    return plans


def _check_inputs(graph, key: SignatureKey, captured: list, where: str) -> None:
    expected = [TensorType(k.dtype, k.shape) for k in key.leaves if k.kind == "tensor"]
    expected += [TensorType(dtype_name(a.dtype), a.shape) for a in captured]
    found = [v.type for v in graph.inputs]
    if found != expected or any(v.role != "arg" for v in graph.inputs):
        raise ExportError(f"{where}: the plan's inputs {[str(t) for t in found]} do not match the "
                          f"signature and captured arrays {[str(t) for t in expected]}")


def _bool_list(raw, length: int, where: str) -> list[bool]:
    if not isinstance(raw, list) or len(raw) != length or any(not isinstance(b, bool) for b in raw):
        raise ExportError(f"{where}: expected {length} true/false flags")
    return raw


# ---- compiled functions -----------------------------------------------------------------------


def _build_compiled(meta: dict, key: SignatureKey, captured: list, plans: dict, common: dict):
    forward, backward = plans["forward"], plans.get("backward")
    _check_inputs(forward.graph, key, captured, "forward plan")
    region = _field(meta, "region", dict, "meta.json")
    flags = _bool_list(meta.get("captured_requires_grad"), len(captured),
                       "meta.json captured_requires_grad")
    wrt = _bool_list(region.get("wrt"), len(forward.graph.inputs), "meta.json region wrt")
    if wrt != [k.requires_grad for k in key.leaves if k.kind == "tensor"] + flags:
        raise ExportError("meta.json: wrt flags disagree with the arguments' requires_grad")
    n_outputs = _field(region, "n_outputs", int, "meta.json region")
    if not 0 <= n_outputs <= len(forward.graph.outputs):
        raise ExportError(f"meta.json: n_outputs {n_outputs} is out of range")
    saved = [_saved_slot(entry, forward.graph) for entry in _field(region, "saved", list, "region")]
    if (backward is not None) != any(wrt):
        raise ExportError("the artifact's backward plan is missing or should not be there")
    if backward is not None:
        _check_backward(forward.graph, backward.graph, n_outputs, saved, wrt)
    plans_obj = RegionPlans(forward, backward, saved, n_outputs, wrt, PassLog())
    names = [k.path for k in key.leaves if k.kind == "tensor"]
    names += [f"captured[{i}]" for i in range(len(captured))]
    program = RegionProgram(plans_obj, name=common["name"], input_names=names)
    out_treedef, out_slots = _outputs(meta, n_outputs)
    tensors = [Tensor(a, requires_grad=f) for a, f in zip(captured, flags, strict=True)]
    traced = TracedFunction(program, out_treedef, out_slots, tensors, tuple(flags), names)
    return LoadedFunction(traced, **common)


def _saved_slot(entry, forward) -> SavedSlot:
    source = entry.get("source") if isinstance(entry, dict) else None
    reason = _field(entry, "reason", str, "meta.json saved slot")[:MAX_NAME]
    if not isinstance(source, list) or len(source) != 2 or type(source[1]) is not int:
        raise ExportError(f"meta.json: bad saved slot source {source!r}")
    kind, index = source
    pool = {"input": forward.inputs, "output": forward.outputs}.get(kind)
    if pool is None or not 0 <= index < len(pool):
        raise ExportError(f"meta.json: saved slot source {source!r} is out of range")
    return SavedSlot((kind, index), pool[index], reason)


def _check_backward(forward, backward, n_outputs: int, saved: list, wrt: list[bool]) -> None:
    """The backward plan's inputs are the float outputs' cotangents then the saved buffers; its
    outputs are the gradients of the wrt inputs, each typed like its input."""
    cotangents = [o.type for o in forward.outputs[:n_outputs] if is_float(o.dtype)]
    expected = [(t, "cotangent") for t in cotangents] + [(s.forward.type, "saved") for s in saved]
    found = [(v.type, v.role) for v in backward.inputs]
    if found != expected:
        raise ExportError("backward plan: its inputs do not match the forward plan's float "
                          "outputs and saved buffers")
    grads = [v.type for v, w in zip(forward.inputs, wrt, strict=True) if w]
    if [o.type for o in backward.outputs] != grads:
        raise ExportError("backward plan: its outputs do not match the inputs needing gradients")


def _outputs(meta: dict, n_outputs: int):
    outputs = _field(meta, "outputs", dict, "meta.json")
    treedef = treedef_from_json(outputs.get("tree"), "meta.json outputs")
    slots = []
    for slot in _field(outputs, "slots", list, "meta.json outputs"):
        if isinstance(slot, list) and len(slot) == 2 and slot[0] == "tensor":
            if type(slot[1]) is not int or not 0 <= slot[1] < n_outputs:
                raise ExportError(f"meta.json: output slot {slot!r} is out of range")
            slots.append(("tensor", slot[1]))
        elif isinstance(slot, list) and len(slot) == 2 and slot[0] == "static":
            slots.append(("static", static_from_json(slot[1], "meta.json output")))
        else:
            raise ExportError(f"meta.json: bad output slot {str(slot)[:80]}")
    if len(slots) != treedef.num_leaves:
        raise ExportError("meta.json: output slots do not match the output structure")
    return treedef, slots


# ---- value_and_grad ---------------------------------------------------------------------------


def _build_joint(meta: dict, key: SignatureKey, captured: list, plans: dict, common: dict):
    plan = plans["joint"]
    _check_inputs(plan.graph, key, captured, "joint plan")
    joint = _field(meta, "joint", dict, "meta.json")
    argnums = _argnums(joint.get("argnums"))
    has_aux = _field(joint, "has_aux", bool, "meta.json joint")
    n_aux = _field(joint, "n_aux", int, "meta.json joint")
    aux_treedef = None
    if has_aux:
        aux_treedef = treedef_from_json(joint.get("aux_tree"), "meta.json aux_tree")
    if n_aux != (aux_treedef.num_leaves if aux_treedef else 0):
        raise ExportError("meta.json: n_aux does not match the aux output structure")
    diff_positions = _diff_positions(key, argnums)
    if joint.get("diff_positions") != sorted(diff_positions):
        raise ExportError("meta.json: the differentiated leaves disagree with argnums")
    tensor_positions = [i for i, k in enumerate(key.leaves) if k.kind == "tensor"]
    wrt = [p in diff_positions for p in tensor_positions] + [False] * len(captured)
    if joint.get("wrt") != wrt:
        raise ExportError("meta.json: joint wrt flags disagree with argnums")
    _check_joint_outputs(plan.graph, n_aux, wrt)
    tensors = [Tensor(a) for a in captured]
    entry = JointTrace(plan, tensors, aux_treedef, n_aux, wrt)
    names = meta.get("display_parameters", [])
    if not isinstance(names, list) or any(not isinstance(n, str) for n in names):
        raise ExportError("meta.json: display_parameters must be a list of names")
    names = [n[:MAX_NAME] for n in names]
    leaves = tuple(replace(k, path=display_path(k.path, names)) for k in key.leaves)
    common["key"] = SignatureKey(key.treedef, leaves)
    return LoadedValueAndGrad(entry, argnums, has_aux, diff_positions, names, **common)


def display_path(path: str, names: list[str]) -> str:
    """value_and_grad binds (*args, **kwargs): show `args[0]['w']` as `params['w']`, as the
    function names it, and `kwargs['k']` as `k`."""
    match = re.match(r"args\[(\d+)\]", path)
    if match and int(match.group(1)) < len(names):
        return names[int(match.group(1))] + path[match.end():]
    match = re.match(r"kwargs\['(\w+)'\]", path)
    return match.group(1) + path[match.end():] if match else path


def _argnums(raw):
    if type(raw) is int and 0 <= raw < 256:
        return raw
    if isinstance(raw, list) and raw and all(type(n) is int and 0 <= n < 256 for n in raw):
        return tuple(raw)
    raise ExportError(f"meta.json: bad argnums {raw!r}")


def _diff_positions(key: SignatureKey, argnums) -> set[int]:
    """Leaf positions under the differentiated positional arguments; all must be float tensors."""
    root = key.treedef
    if root.meta != ("args", "kwargs") or root.children[0].kind != "tuple":
        raise ExportError("meta.json: a value_and_grad artifact takes (*args, **kwargs)")
    nums = (argnums,) if isinstance(argnums, int) else argnums
    args_def = root.children[0]
    positions, start = set(), 0
    for i, child in enumerate(args_def.children):
        if i in nums:
            positions.update(range(start, start + child.num_leaves))
        start += child.num_leaves
    if any(n >= len(args_def.children) for n in nums):
        raise ExportError(f"meta.json: argnums {argnums} but only {len(args_def.children)} "
                          "positional arguments")
    for p in positions:
        leaf = key.leaves[p]
        if leaf.kind != "tensor" or not is_float(leaf.dtype):
            raise ExportError(f"meta.json: differentiated leaf {leaf.path} is not a float tensor")
    return positions


def _check_joint_outputs(graph, n_aux: int, wrt: list[bool]) -> None:
    outputs = graph.outputs
    grads = [v.type for v, w in zip(graph.inputs, wrt, strict=True) if w]
    if len(outputs) != 1 + n_aux + len(grads):
        raise ExportError("joint plan: wrong number of outputs for the value, aux and gradients")
    if outputs[0].shape != () or not is_float(outputs[0].dtype):
        raise ExportError(f"joint plan: the value must be a float scalar, not {outputs[0].type}")
    if [o.type for o in outputs[1 + n_aux :]] != grads:
        raise ExportError("joint plan: gradient outputs are not typed like their inputs")
