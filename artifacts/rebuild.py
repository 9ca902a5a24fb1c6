"""Rebuilding runnable plans from a parsed artifact, after checking that the plans fit each
other and the signature: a compiled function's forward and backward plans and saved slots, or
value_and_grad's joint plan, its argnums and its outputs."""

from __future__ import annotations

import re
from dataclasses import replace

from backplan.ir.pipeline import PassLog
from backplan.ir.plans import RegionPlans, SavedSlot
from backplan.ir.types import is_float
from backplan.runtime import RegionProgram
from backplan.tracer.compile import TracedFunction
from backplan.tracer.functional import JointTrace
from backplan.tracer.signature import SignatureKey
from backplan.tracer.tensor import Tensor

from .format import ExportError
from .loaded import LoadedFunction, LoadedValueAndGrad
from .meta import MAX_NAME, bool_list, check_inputs, field
from .tree import static_from_json, treedef_from_json

# ---- compiled functions -----------------------------------------------------------------------


def build_compiled(
    meta: dict,
    key: SignatureKey,
    captured: list,
    captured_names: list[str],
    plans: dict,
    common: dict,
):
    forward = plans["forward"]
    check_inputs(forward.graph, key, captured, "forward plan")
    region = field(meta, "region", dict, "meta.json")
    flags = bool_list(
        meta.get("captured_requires_grad"), len(captured), "meta.json captured_requires_grad"
    )
    wrt = bool_list(region.get("wrt"), len(forward.graph.inputs), "meta.json region wrt")
    if wrt != [k.requires_grad for k in key.leaves if k.kind == "tensor"] + flags:
        raise ExportError("meta.json: wrt flags disagree with the arguments' requires_grad")
    names = [k.path for k in key.leaves if k.kind == "tensor"]
    names += captured_names
    tensors = [Tensor(a, requires_grad=f) for a, f in zip(captured, flags, strict=True)]
    traced = compiled_entry(meta, plans, wrt, common["name"], (tensors, tuple(flags), names))
    return LoadedFunction(traced, **common)


def compiled_entry(meta: dict, plans: dict, wrt: list[bool], name: str, inputs: tuple):
    """A compiled signature's entry from meta's outputs and region and its plans; inputs:
    (captured tensors, their requires_grad flags, input names), shared by a dynamic
    artifact's entries (its sizes 0 and 1 are entries of their own)."""
    captured, flags, names = inputs
    plans_obj = region_plans(meta, plans["forward"], plans.get("backward"), wrt)
    program = RegionProgram(plans_obj, name=name, input_names=names)
    out_treedef, out_slots = _outputs(meta, plans_obj.n_outputs)
    return TracedFunction(program, out_treedef, out_slots, captured, flags, names)


def entry_at_size(loaded, fields: dict, plans: dict, key: SignatureKey):
    """A dynamic artifact's entry at size 0 or 1 (plans traced at that size at export),
    checked against the signature at that size and the exported entry's outputs: it shares
    the exported entry's captured tensors, so their gradients land in one place."""
    arrays = [t.numpy() for t in loaded.captured]
    if isinstance(loaded, LoadedFunction):
        check_inputs(plans["forward"].graph, key, arrays, "forward plan")
        traced, wrt = loaded._traced, list(loaded.program.plans.wrt)
        if field(fields, "region", dict, "meta.json dynamic special").get("wrt") != wrt:
            raise ExportError("meta.json dynamic special: wrt flags disagree with the signature")
        inputs = (traced.captured, traced.captured_flags, traced.input_names)
        return compiled_entry(fields, plans, wrt, loaded.name, inputs)
    plan = plans["joint"]
    check_inputs(plan.graph, key, arrays, "joint plan")
    entry = loaded._entry
    _check_joint_outputs(plan.graph, entry.n_aux, entry.wrt)
    return replace(entry, plan=plan, _runners={})


def region_plans(meta: dict, forward, backward, wrt: list[bool]) -> RegionPlans:
    """The region's plans from meta.json's region (outputs, saved slots) and its two plans,
    checked to fit each other (a dynamic artifact builds one per stored size)."""
    region = field(meta, "region", dict, "meta.json")
    n_outputs = field(region, "n_outputs", int, "meta.json region")
    if not 0 <= n_outputs <= len(forward.graph.outputs):
        raise ExportError(f"meta.json: n_outputs {n_outputs} is out of range")
    saved = [_saved_slot(entry, forward.graph) for entry in field(region, "saved", list, "region")]
    if (backward is not None) != any(wrt):
        raise ExportError("the artifact's backward plan is missing or should not be there")
    if backward is not None:
        _check_backward(forward.graph, backward.graph, n_outputs, saved, wrt)
    return RegionPlans(forward, backward, saved, n_outputs, wrt, PassLog())


def _saved_slot(entry, forward) -> SavedSlot:
    source = entry.get("source") if isinstance(entry, dict) else None
    reason = field(entry, "reason", str, "meta.json saved slot")[:MAX_NAME]
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
        raise ExportError(
            "backward plan: its inputs do not match the forward plan's float "
            "outputs and saved buffers"
        )
    grads = [v.type for v, w in zip(forward.inputs, wrt, strict=True) if w]
    if [o.type for o in backward.outputs] != grads:
        raise ExportError("backward plan: its outputs do not match the inputs needing gradients")


def _outputs(meta: dict, n_outputs: int):
    outputs = field(meta, "outputs", dict, "meta.json")
    treedef = treedef_from_json(outputs.get("tree"), "meta.json outputs")
    slots = []
    for slot in field(outputs, "slots", list, "meta.json outputs"):
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


def build_joint(
    meta: dict,
    key: SignatureKey,
    captured: list,
    captured_names: list[str],
    plans: dict,
    common: dict,
):
    plan = plans["joint"]
    check_inputs(plan.graph, key, captured, "joint plan")
    joint = field(meta, "joint", dict, "meta.json")
    argnums = _argnums(joint.get("argnums"))
    has_aux = field(joint, "has_aux", bool, "meta.json joint")
    n_aux = field(joint, "n_aux", int, "meta.json joint")
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
    return LoadedValueAndGrad(
        entry, argnums, has_aux, diff_positions, names, captured_names, **common
    )


def display_path(path: str, names: list[str]) -> str:
    """value_and_grad binds (*args, **kwargs): show `args[0]['w']` as `params['w']`, as the
    function names it, and `kwargs['k']` as `k`."""
    match = re.match(r"args\[(\d+)\]", path)
    if match and int(match.group(1)) < len(names):
        return names[int(match.group(1))] + path[match.end() :]
    match = re.match(r"kwargs\['(\w+)'\]", path)
    return match.group(1) + path[match.end() :] if match else path


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
        raise ExportError(
            f"meta.json: argnums {argnums} but only {len(args_def.children)} positional arguments"
        )
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
