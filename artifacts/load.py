"""bp.load: read an artifact, check everything, and rebuild runnable plans from the IR text.

Checks, in order: the zip's end record (member count, directory size), its member names, the
signature when a key is given, the manifest (format, version, SHA-256 and size of every
member), the metadata's structure, every array's header (dtype, shape, no
pickles), every plan (parsed against the op registry, liveness recomputed, verifier), and how
the plans fit together and with the signature, and the peak memory and FLOPs against the
caller's limits. Any failure is an ExportError at load time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from backplan.ir.errors import BackplanError

from .container import ArtifactContents, read_artifact
from .dynamic import MAX_REASON, fit_loaded
from .flops import graph_flops
from .format import ExportError, npy_to_array, parse_json, parse_text
from .meta import MAX_NAME, check_dtype, check_shape, field, signature_key
from .plans import machine_memory_bytes, read_plan
from .rebuild import build_compiled, build_joint, entry_at_size, region_plans
from .tree import signature_from_json


@dataclass(frozen=True)
class Limits:
    """What the caller allows one loaded call to use."""

    max_bytes: int
    max_flops: int | None


PLAN_ROLES = {"compiled": ({"forward"}, {"forward", "backward"}), "value_and_grad": ({"joint"},)}


def load(
    path: str | os.PathLike[str],
    max_bytes: int | None = None,
    key: bytes | str | None = None,
    max_flops: int | None = None,
) -> Any:
    """Load an artifact written by bp.export: a callable with the exported signature (and
    explain()), needing none of the model's source. Nothing in the file is unpickled or run.
    max_bytes caps a plan's peak memory (default: this machine's physical memory); max_flops
    caps the arithmetic of one call, all plans together (default: no cap). With key (the one
    given to bp.export), an unsigned file or any edit is refused; without it a signed file
    loads, and `loaded.authenticity` says it was not verified.

    >>> import backplan as bp
    >>> bp.load("no/such/file.bpz")
    Traceback (most recent call last):
    ...
    backplan.artifacts.format.ExportError: no/such/file.bpz: no such artifact file
    """
    where = os.fspath(path)
    contents = read_artifact(where, key)
    reader = _MemberReader(contents.members)
    limits = Limits(max_bytes or machine_memory_bytes(), _checked_max_flops(max_flops))
    try:
        loaded = _build(where, contents, reader, limits)
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


def _build(where: str, contents: ArtifactContents, reader: _MemberReader, limits: Limits):
    meta = parse_json(reader.get("meta.json"), "meta.json")
    kind = field(meta, "kind", str, "meta.json")
    if kind not in PLAN_ROLES:
        raise ExportError(f"meta.json: unknown artifact kind {kind!r}")
    name = field(meta, "name", str, "meta.json")
    if not name.isprintable() or len(name) > MAX_NAME:
        raise ExportError("meta.json: the function name is not a short printable string")
    key = signature_key(field(meta, "arguments", dict, "meta.json"))
    captured = [
        _read_array(reader, entry, f"captured[{i}]")
        for i, entry in enumerate(field(meta, "captured", list, "meta.json"))
    ]
    names = _captured_names(meta.get("captured_names"), len(captured))
    plans = _read_plans(reader, field(meta, "plans", dict, "meta.json"), kind, limits.max_bytes)
    flops = {role: graph_flops(plan.graph) for role, plan in plans.items()}
    _check_flops(flops, limits.max_flops)
    common = {
        "path": where,
        "manifest": contents.manifest,
        "authenticity": contents.authenticity,
        "members": reader.members,
        "name": name,
        "signature": signature_from_json(meta.get("parameters"), "meta.json parameters"),
        "key": key,
        "flops": flops,
    }
    if set(common["signature"].parameters) != set(key.treedef.meta or ()):
        raise ExportError("meta.json: the parameters do not match the argument structure")
    if kind == "compiled":
        loaded = build_compiled(meta, key, captured, names, plans, common)
    else:
        loaded = build_joint(meta, key, captured, names, plans, common)
    if "dynamic" in meta:
        _make_dynamic(loaded, meta, reader, kind, limits)
    return loaded


def _make_dynamic(loaded, meta: dict, reader: _MemberReader, kind: str, limits: Limits) -> None:
    """A dynamic artifact: the plans stored at 2n and 3n, fitted with the first into one plan
    of the symbol (a stored plan that does not fit is refused)."""
    dynamic = field(meta, "dynamic", dict, "meta.json")
    symbol = field(dynamic, "symbol", str, "meta.json dynamic")[:MAX_NAME]
    sizes = dynamic.get("sizes")
    if not (isinstance(sizes, list) and len(sizes) == 3 and all(type(n) is int for n in sizes)):
        raise ExportError("meta.json dynamic: sizes must be three integers")
    places = [tuple(p) for p in field(dynamic, "places", list, "meta.json dynamic")]
    stored = field(dynamic, "plans", dict, "meta.json dynamic")
    if sorted(stored) != sorted(str(n) for n in sizes[1:]):
        raise ExportError("meta.json dynamic: plans must be stored at the second and third sizes")
    probes = []
    for n in sizes[1:]:
        plans = _read_plans(reader, stored[str(n)], kind, limits.max_bytes)
        if kind == "compiled":
            template = loaded.program.plans
            probes.append(region_plans(meta, plans["forward"], plans.get("backward"), template.wrt))
        else:
            probes.append(plans["joint"])
    template = loaded.program.plans if kind == "compiled" else loaded.plan
    loaded.make_dynamic(symbol, sizes[0], places, fit_loaded(kind, template, probes, sizes))
    special = field(dynamic, "special", dict, "meta.json dynamic") if "special" in dynamic else {}
    if not set(special) <= {"0", "1"}:
        raise ExportError("meta.json dynamic: special sizes are 0 and 1 only")
    for size, fields in special.items():
        _add_special_size(loaded, int(size), fields, reader, kind, limits)


def _add_special_size(loaded, size: int, fields, reader: _MemberReader, kind: str, limits) -> None:
    """The plans traced at size 0 or 1 when exported, or why they could not be."""
    where = f"meta.json dynamic special {size}"
    if isinstance(fields, dict) and "refused" in fields:
        reason = field(fields, "refused", str, where)
        if not reason.isprintable():
            raise ExportError(f"{where}: the reason is not printable text")
        loaded.refuse_size(size, reason[:MAX_REASON])
        return
    plans = _read_plans(reader, field(fields, "plans", dict, where), kind, limits.max_bytes)
    _check_flops({role: graph_flops(plan.graph) for role, plan in plans.items()}, limits.max_flops)
    loaded.add_size(size, entry_at_size(loaded, fields, plans, loaded.key_at(size)))


def _checked_max_flops(max_flops):
    if max_flops is None:
        return None
    if isinstance(max_flops, bool) or not isinstance(max_flops, int | float) or max_flops < 0:
        raise ExportError(f"max_flops must be a number of FLOPs >= 0, got {max_flops!r}")
    return max_flops


def _check_flops(flops: dict[str, int], max_flops: int | None) -> None:
    """Refused before anything compiles or runs: memory is bounded by max_bytes, time by this."""
    total = sum(flops.values())
    if max_flops is not None and total > max_flops:
        parts = ", ".join(f"{role} {count:,}" for role, count in flops.items())
        raise ExportError(
            f"one call computes {total:,} FLOPs ({parts}), more than max_flops={max_flops:,}; "
            "pass a larger max_flops= to load() if this is intended"
        )


def _captured_names(raw, count: int) -> list[str]:
    """How the model's code called its captured tensors ('w (captured)'), for reports only."""
    if raw is None:
        return [f"captured[{i}]" for i in range(count)]
    if (
        not isinstance(raw, list)
        or len(raw) != count
        or any(not isinstance(n, str) or not n.isprintable() for n in raw)
    ):
        raise ExportError("meta.json: captured_names must be one printable name per array")
    return [n[:MAX_NAME] for n in raw]


def _read_array(reader: _MemberReader, entry, where: str):
    dtype = check_dtype(entry.get("dtype") if isinstance(entry, dict) else None, where)
    shape = check_shape(entry.get("shape"), where)
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
            for cname, centry in field(entry, "constants", dict, where).items()
        }
        text = parse_text(reader.get(entry.get("ir")), entry.get("ir"))
        facts = parse_json(reader.get(entry.get("facts")), entry.get("facts"))
        plans[role] = read_plan(text, facts, constants, entry.get("ir"), max_bytes)
    return plans
