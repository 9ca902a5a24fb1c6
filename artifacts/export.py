"""bp.export: write a compiled function (or value_and_grad of one) as a self-contained artifact.

The artifact is one zip file (`.bpz` by convention) holding:

    manifest.json           format name and version, backplan version, SHA-256 and size of
                            every other member
    meta.json               kind, name, parameters, argument and output pytrees with every
                            leaf's dtype and shape (or static value), saved-slot mapping, wrt
                            flags, and where each array lives
    ir/<plan>.txt           each plan in the IR text form, free statements included
    plans/<plan>.json       schedule, last reads, frees, bytes live after each step, peak bytes,
                            a joint plan's derivative reasons
    arrays/<name>.npy       captured tensors and graph constants (plain dtypes, no pickles)

Plans are `forward` and `backward` for a compiled function, `joint` for value_and_grad.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from importlib import metadata
from typing import Any

from backplan.ir.liveness import Plan
from backplan.ir.types import dtype_name
from backplan.tracer.captured_names import captured_names
from backplan.tracer.compile import CompiledFunction
from backplan.tracer.dynamic import captured_change
from backplan.tracer.functional import ValueAndGradFunction

from .container import write_artifact
from .dynamic import dynamic_meta, with_dynamic
from .format import ExportError, array_to_npy, json_bytes
from .plans import plan_facts
from .signing import key_bytes
from .tree import (
    leaf_paths,
    parameters_to_json,
    static_to_json,
    treedef_to_json,
)


def export(
    fn: Callable[..., Any],
    *example_args: Any,
    path: str | os.PathLike[str],
    key: bytes | str | None = None,
    dynamic: dict | None = None,
    **example_kwargs: Any,
) -> str:
    """Trace fn on the example arguments and write the artifact to path; returns the path.
    fn is a @bp.compile function, or bp.value_and_grad(...) of one (then the artifact holds the
    joint forward-and-backward plan). Load it anywhere with bp.load(path), without the model's
    source. With key (bytes or str, a secret), the file carries an HMAC-SHA256 of its manifest
    and bp.load(path, key=key) refuses any edit; `path` and `key` are export's own keywords.

    >>> import numpy as np, os, tempfile, backplan as bp
    >>> @bp.compile
    ... def f(w, x):
    ...     return bp.tanh(x @ w).sum()
    >>> w = bp.tensor(np.ones((3, 2), np.float32), requires_grad=True)
    >>> x = np.ones((4, 3), np.float32)
    >>> path = bp.export(f, w, x, path=os.path.join(tempfile.mkdtemp(), "f.bpz"))
    >>> round(bp.load(path)(w, x).item(), 4) == round(f(w, x).item(), 4) == 7.9604
    True
    """
    if key is not None:
        key_bytes(key)  # refuse a bad key before tracing
    writer = _ArtifactWriter()
    if isinstance(fn, CompiledFunction | ValueAndGradFunction):
        fn = with_dynamic(fn, dynamic)
    if isinstance(fn, CompiledFunction):
        meta = _compiled_meta(fn, example_args, example_kwargs, writer)
    elif type(fn) is ValueAndGradFunction:  # bp.grad's results differ: not exportable yet
        meta = _joint_meta(fn, example_args, example_kwargs, writer)
    else:
        raise ExportError(
            f"export needs a @bp.compile function or bp.value_and_grad(...) of one, got "
            f"{getattr(fn, '__qualname__', type(fn).__name__)}; decorate it with @bp.compile"
        )
    writer.members["meta.json"] = json_bytes(meta)
    return write_artifact(
        path,
        writer.members,
        {"backplan_version": _backplan_version(), "kind": meta["kind"], "name": meta["name"]},
        key=key,
    )


class _ArtifactWriter:
    """Collects members; each distinct array is stored once."""

    def __init__(self):
        self.members: dict[str, bytes] = {}
        self._array_ids: dict[int, str] = {}

    def add_array(self, array, stem: str) -> dict:
        member = self._array_ids.get(id(array))
        if member is None:
            member = f"arrays/{stem}_{len(self._array_ids)}.npy"
            self._array_ids[id(array)] = member
            self.members[member] = array_to_npy(array)
        return {"member": member, "dtype": dtype_name(array.dtype), "shape": list(array.shape)}

    def add_plan(self, role: str, plan: Plan) -> dict:
        self.members[f"ir/{role}.txt"] = plan.text().encode("utf-8")
        self.members[f"plans/{role}.json"] = json_bytes(plan_facts(plan))
        constants = {
            name: self.add_array(array, "const") for name, array in plan.graph.constants.items()
        }
        return {"ir": f"ir/{role}.txt", "facts": f"plans/{role}.json", "constants": constants}


def _compiled_meta(fn: CompiledFunction, args, kwargs, writer: _ArtifactWriter) -> dict:
    call, traced = fn.lookup(args, kwargs)
    meta = _common_meta("compiled", traced.program.name, call, traced.captured, writer)
    meta["parameters"] = parameters_to_json(inspect.signature(fn.fn))
    meta["captured_requires_grad"] = list(traced.captured_flags)
    meta["captured_names"] = traced.input_names[len(traced.input_names) - len(traced.captured) :]
    meta.update(_region_fields(traced, writer, ""))
    dynamic = dynamic_meta(
        fn,
        call,
        writer,
        lambda fitted, n: _region_roles(fitted.at(n)),
        lambda entry, n: _region_fields(_same_captured(entry, traced), writer, f"_at_{n}"),
    )
    if dynamic is not None:
        meta["dynamic"] = dynamic
    return meta


def _region_fields(traced, writer: _ArtifactWriter, suffix: str) -> dict:
    """meta.json's outputs, region and plans of one traced signature (suffix: a dynamic
    artifact's plans at sizes 0 and 1 are stored as forward_at_1 and so on)."""
    plans = traced.program.plans
    return {
        "outputs": {
            "tree": treedef_to_json(traced.out_treedef, "output"),
            "slots": [
                [kind, item if kind == "tensor" else static_to_json(item, "output")]
                for kind, item in traced.out_slots
            ],
        },
        "region": {
            "n_outputs": plans.n_outputs,
            "wrt": list(plans.wrt),
            "saved": [{"source": list(s.source), "reason": s.reason} for s in plans.saved],
        },
        "plans": {
            role: writer.add_plan(role + suffix, plan)
            for role, plan in _region_roles(plans).items()
        },
    }


def _same_captured(entry, template):
    """entry, when it captured the tensors the exported signature captured, or arrays equal to
    them (the artifact stores them once for every size)."""
    changed = captured_change(template.captured, entry.captured)
    if changed is not None:
        raise ExportError(f"at this size {changed}")
    return entry


def _region_roles(plans) -> dict:
    roles = {"forward": plans.forward}
    if plans.backward is not None:
        roles["backward"] = plans.backward
    return roles


def _joint_meta(fn, args, kwargs, writer: _ArtifactWriter) -> dict:
    bound, entry = fn.lookup(args, kwargs)
    args, call, diff_paths = bound.args, bound.call, bound.diff_paths
    meta = _common_meta("value_and_grad", entry.plan.graph.name, call, entry.captured, writer)
    meta["parameters"] = [
        {"name": "args", "kind": "VAR_POSITIONAL"},
        {"name": "kwargs", "kind": "VAR_KEYWORD"},
    ]
    meta["display_parameters"] = _display_names(fn)
    meta["captured_names"] = captured_names(getattr(fn, "__wrapped__", fn), entry.captured)
    argnums = fn.argnums
    meta["joint"] = {
        "argnums": argnums if isinstance(argnums, int) else list(argnums),
        "has_aux": bool(fn.has_aux),
        "n_aux": entry.n_aux,
        "aux_tree": None
        if entry.aux_treedef is None
        else treedef_to_json(entry.aux_treedef, "aux output"),
        "wrt": list(entry.wrt),
        "diff_positions": sorted(diff_paths),
    }
    meta["plans"] = {"joint": writer.add_plan("joint", entry.plan)}
    dynamic = dynamic_meta(
        fn,
        bound,
        writer,
        lambda fitted, n: {"joint": fitted.at(n)[0]},
        lambda other, n: _joint_at(other, entry, writer, n),
    )
    if dynamic is not None:
        meta["dynamic"] = dynamic
    return meta


def _joint_at(other, entry, writer: _ArtifactWriter, n: int) -> dict:
    """meta.json's fields of the joint plan traced at size n (0 or 1) of a dynamic axis."""
    _same_captured(other, entry)
    if (other.n_aux, other.wrt) != (entry.n_aux, entry.wrt):
        raise ExportError("the function returns other outputs at this size")
    return {"plans": {"joint": writer.add_plan(f"joint_at_{n}", other.plan)}}


def _common_meta(kind: str, name: str, call, captured: list, writer: _ArtifactWriter) -> dict:
    treedef = call.key.treedef
    paths = leaf_paths(treedef)
    leaves = []
    for path, key in zip(paths, call.key.leaves, strict=True):
        if key.kind == "tensor":
            leaves.append(
                {
                    "path": path,
                    "kind": "tensor",
                    "dtype": key.dtype,
                    "shape": list(key.shape),
                    "requires_grad": key.requires_grad,
                    "float": key.weak,
                }
            )
        else:
            leaves.append(
                {
                    "path": path,
                    "kind": "static",
                    "value": static_to_json(key.static[1], f"argument {path}"),
                }
            )
    return {
        "kind": kind,
        "name": name,
        "arguments": {"tree": treedef_to_json(treedef, "arguments"), "leaves": leaves},
        "captured": [writer.add_array(t.numpy(), "captured") for t in captured],
    }


def _display_names(fn) -> list[str]:
    """The wrapped function's positional parameter names, for printing the signature only."""
    try:
        params = inspect.signature(fn.__wrapped__).parameters.values()
    except (AttributeError, TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in params if p.kind in kinds]


def _backplan_version() -> str:
    try:
        return metadata.version("backplan")
    except metadata.PackageNotFoundError:
        return "unknown"
