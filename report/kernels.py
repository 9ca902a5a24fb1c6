"""Which IR steps each kernel covers, for explain(). On the reference interpreter every step is
its own kernel; the numba backend runs the kernels of the lowered plan (`backplan.ir.lowering`:
fused loops; views, aliases and literals that cost no kernel), and `planned_groups` reads them.

The groups interface: a dict from plan name ("forward", "backward", or "joint" for
value_and_grad) to a list of groups in run order. A group is a sequence of node indices of that
plan, a sequence of the plan's nodes, or an object with `all_nodes` (and optionally `kind`), as
`backplan.ir.fusion.Kernel` has. Steps no group mentions stay kernels of their own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from backplan.codegen.render.emit import generate
from backplan.ir.errors import BackplanError
from backplan.ir.liveness import Plan
from backplan.ir.lowering import RUN_KINDS, lower, runs_code
from backplan.ir.widen import has_half

from .plan_view import PlanView


@dataclass(frozen=True)
class KernelInfo:
    steps: tuple[int, ...]  # global steps of the view, in run order
    kind: str = "op"
    epilogue: bool = False  # a GEMM that runs the loop after it on each block of its result
    stages: int = 1  # a row kernel: the loops it runs as stages of one loop over the rows
    calls: int = 1  # a long sum of arrays: the shared add kernels it runs as, one call each
    gemm: str = ""  # a kernel computing a matmul: the GEMM it calls, in words

    @property
    def fused(self) -> bool:
        return len(self.steps) > 1

    @property
    def runs_code(self) -> bool:
        return self.kind in RUN_KINDS


def kept_float32(view: PlanView, plans: Mapping[str, Plan]) -> tuple[int, ...]:
    """The steps whose 16-bit result a fused loop keeps in float32 for the ops after it,
    rounding it only where a buffer stores it: the reference interpreter running the plans
    rounds at the same points (ir/rounding_points.py), so on either backend. () without
    16-bit values."""
    if not any(has_half(p.graph) for p in plans.values()):
        return ()
    phases, kept = _steps_by_plan(view), set()
    for name, plan in plans.items():
        lowered = lower(plan)
        if lowered.origin is None or name not in phases:
            continue
        for source in lowered.interpreted.unrounded.values():
            step = phases[name][1].get(id(lowered.origin.get(source)))
            if step is not None:
                kept.add(step)
    return tuple(sorted(kept))


def planned_groups(plans: Mapping[str, Plan], backend: str) -> dict | None:
    """The groups the backend will run: fusion's for numba, none (one step each) for the
    reference interpreter. Nothing is compiled to find out."""
    if backend != "numba":
        return None
    return {name: _user_groups(lower(plan)) for name, plan in plans.items()}


@dataclass(frozen=True)
class _Group:
    all_nodes: tuple
    kind: str
    epilogue: object = None
    stages: int = 1
    calls: int = 1
    gemm: str = ""


def _driver_groups(lowered) -> list:
    """The lowered plan's kernels as its driver calls them (LoweredPlan.calls): the stages of
    a row kernel as one loop, a constant as no kernel (the driver reads the array), nor a loop
    whose values are all recomputed where they are read, a matmul + epilogue that the code
    generator runs as a BLAS call and then the loop as those two."""
    rendered = generate(lowered)
    apart, calls_of, gemms = rendered.epilogues_apart, rendered.calls_of, rendered.gemms

    def counted(kernel):  # a long sum runs as shared adds, an op may call several kernels
        n = calls_of.get(kernel.nodes[-1], 1) if kernel.nodes else 1
        gemm = next((gemms[v] for v in kernel.all_nodes if v in gemms), "")
        if n > 1 or gemm:
            epilogue = kernel.epilogue if n == 1 else None
            return _Group(tuple(kernel.all_nodes), kernel.kind, epilogue, calls=n, gemm=gemm)
        return kernel

    calls = dict(lowered.calls())
    groups, index = [], 0
    while index < len(lowered.kernels):
        kernel, end = lowered.kernels[index], calls.get(index, index + 1)
        if end > index + 1:
            stages = [k for k in lowered.kernels[index:end] if runs_code(k)]
            nodes = tuple(n for k in stages for n in k.all_nodes)
            groups.append(_Group(nodes, "loop", stages=len(stages)))
            groups += [k for k in lowered.kernels[index:end] if not runs_code(k)]
        elif kernel.kind in RUN_KINDS and not runs_code(kernel):
            groups.append(_Group(tuple(kernel.all_nodes), "constant"))
        elif kernel.kind in RUN_KINDS and not lowered.runs(kernel):
            groups.append(_Group(tuple(kernel.all_nodes), "recomputed where read"))
        elif kernel.epilogue is not None and kernel.nodes[0] in apart:
            gemm = gemms.get(kernel.nodes[0], "")
            product = _Group(tuple(kernel.nodes), kernel.kind, gemm=gemm)
            groups += [product, counted(kernel.epilogue)]
        else:
            groups.append(counted(kernel))
        index = end
    return groups


def _user_groups(lowered) -> list:
    """The kernels the driver calls, in the nodes of the plan the user's IR shows: a plan
    widened for 16-bit floats names its casts' ops instead (the first kernel computing a node
    takes it)."""
    driver = _driver_groups(lowered)
    if lowered.origin is None:
        return driver
    groups, taken = [], set()
    for kernel in driver:
        nodes = dict.fromkeys(lowered.origin[n] for n in kernel.all_nodes if n in lowered.origin)
        nodes = tuple(n for n in nodes if n not in taken)
        taken.update(nodes)
        if nodes:
            stages, calls = getattr(kernel, "stages", 1), getattr(kernel, "calls", 1)
            epilogue = getattr(kernel, "epilogue", None)
            gemm = getattr(kernel, "gemm", "")
            groups.append(_Group(nodes, kernel.kind, epilogue, stages, calls, gemm))
    return groups


def one_kernel_per_step(view: PlanView) -> list[KernelInfo]:
    return [KernelInfo((step.index,), "op") for step in view.steps]


def kernels_from_groups(view: PlanView, groups: Mapping[str, Sequence] | None) -> list[KernelInfo]:
    if not groups:
        return one_kernel_per_step(view)
    phases = _steps_by_plan(view)
    unknown = set(groups) - set(phases)
    if unknown:
        raise BackplanError(
            f"kernel groups name unknown plan(s) {sorted(unknown)}; this report "
            f"has {sorted(phases)}"
        )
    kernels, covered = [], set()
    for plan_name, plan_groups in groups.items():
        steps = phases[plan_name]
        for group in plan_groups:
            members = tuple(_resolve(member, steps, plan_name) for member in _members(group))
            if covered.intersection(members):
                raise BackplanError(f"kernel groups of the {plan_name} plan cover a step twice")
            covered.update(members)
            kind = getattr(group, "kind", "op")
            epilogue = getattr(group, "epilogue", None) is not None
            stages, calls = getattr(group, "stages", 1), getattr(group, "calls", 1)
            gemm = getattr(group, "gemm", "")
            info = KernelInfo(tuple(sorted(members)), kind, epilogue, stages, calls, gemm)
            kernels.append(info)
    kernels += [KernelInfo((s.index,), "op") for s in view.steps if s.index not in covered]
    return sorted(kernels, key=lambda k: k.steps[0] if k.steps else -1)


def _members(group) -> Sequence:
    return getattr(group, "all_nodes", group)


def _steps_by_plan(view: PlanView) -> dict[str, tuple[dict, dict]]:
    """Per plan name: node index or node -> global step."""
    if view.joint:
        return {"joint": _index(view.steps)}
    forward = [s for s in view.steps if s.phase == "forward"]
    backward = [s for s in view.steps if s.phase == "backward"]
    return {"forward": _index(forward), "backward": _index(backward)}


def _index(steps) -> tuple[dict[int, int], dict[int, int]]:
    """(node index -> global step, id(node) -> global step)."""
    by_position = {i: step.index for i, step in enumerate(steps)}
    return by_position, {id(step.node): step.index for step in steps}


def _resolve(member, steps: tuple[dict, dict], plan_name: str) -> int:
    by_position, by_node = steps
    table, key = (by_position, member) if isinstance(member, int) else (by_node, id(member))
    if key not in table:
        raise BackplanError(
            f"kernel group of the {plan_name} plan names {member!r}, which is not "
            f"a node of that plan"
        )
    return table[key]
