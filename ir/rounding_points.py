"""Where a compiled 16-bit plan rounds, told to the reference interpreter.

ir/widen.py writes every op on bfloat16 or float16 as float32 arithmetic followed by a
rounding into 16 bits (`astype`), and each reader widens the 16-bit value back (`astype` to
float32). A fused loop does not round a value it only passes on in registers: a widening
cast of a 16-bit value that the same loop rounded from a float32 value it computed (or from
the float32 product of the GEMM whose epilogue it is) reads that float32 value instead
(`float32_source`, the rule codegen/render/loops.py applies). A chain of fused ops rounds
once, where a buffer stores it, as PyTorch's compiled kernels do (torch.compile, whose
`emulate_precision_casts` is off by default) and unlike XLA on the CPU (jax.jit rounds every
op there); docs/ops.md, "Where 16-bit results are rounded".

A loop that reads the stored 16-bit value back and widens it again (a widening fusion
recomputes where it is read) reads the rounded value: what one value is depends on the loop
reading it. `rounding_points(kernels)` writes down both, in terms of the nodes:
`held`, each cast whose own loop reads the float32 value (so does every reader that reads
the cast's buffer); `reads`, each node whose loop computes one of its input casts otherwise.
The reference interpreter running a lowered plan (`lower(plan).interpreted`: the reference
backend, and the calls a background build leaves to it) takes both (`reference_plan`), so it
rounds where the compiled loops do. Left out: a node recomputed in a loop other than its own
whose casts that loop computes otherwise is interpreted as its own loop computes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .fusion import Kernel, alias_base
from .graph import Value
from .liveness import Plan
from .types import is_half


def float32_source(node: Value, local, products) -> Value | None:
    """For a widening cast of a 16-bit value that a loop computing `local` rounded from a
    float32 value it holds (computed in the loop, or one of `products`: the GEMM product its
    epilogue reads), that float32 value; None where the loop widens the rounded value."""
    if node.op != "astype" or not is_half(node.inputs[0].dtype):
        return None
    inner = node.inputs[0]
    if inner not in local or inner.op != "astype" or alias_base(inner) is not inner:
        return None
    source = inner.inputs[0]
    if source.dtype != node.dtype or alias_base(source) is not source:
        return None
    return source if source in local or source in products else None


@dataclass(frozen=True)
class Widened:
    """A 16-bit value widened again: what a loop reads at a cast it does not skip."""

    of: object  # Value or spec
    dtype: str


@dataclass(frozen=True)
class Recomputed:
    """A node as a loop other than its own recomputes it, from these inputs (Value or spec)."""

    node: Value
    inputs: tuple


@dataclass
class RoundingPoints:
    """What the loops of a lowered plan compute at its widening casts (module docstring)."""

    # cast -> what its own loop holds in its place (the float32 value it was rounded from)
    held: dict = field(default_factory=dict)
    # node -> {input: what the node's loop reads}, where that differs from the input's value
    reads: dict = field(default_factory=dict)


def rounding_points(kernels: list[Kernel]) -> RoundingPoints:
    points, loops = RoundingPoints(), []
    for kernel in kernels:
        if kernel.epilogue is not None:  # a GEMM's epilogue reads its float32 product
            loops.append((kernel.epilogue, {kernel.nodes[0]}))
        elif kernel.kind == "loop":
            loops.append((kernel, ()))
    decided = []
    for loop, products in loops:
        local = set(loop.computed)
        casts = {
            n: float32_source(n, local, products)
            for n in loop.recomputed + loop.nodes
            if n.op == "astype" and is_half(n.inputs[0].dtype)
        }
        decided.append((loop, casts))
        points.held.update((n, casts[n]) for n in loop.nodes if casts.get(n) is not None)
    for loop, casts in decided:
        if casts:
            _loop_reads(loop, casts, points)
    return points


def _loop_reads(loop: Kernel, casts: dict, points: RoundingPoints) -> None:
    """points.reads of loop's own nodes, and points.held's values as loop holds them: each
    value loop computes otherwise than its own value (a cast it skips where the cast's own
    loop does not, or the other way; anything it recomputes from such a value)."""
    own = set(loop.nodes)
    version: dict[Value, object] = {}  # value -> how loop computes it, where that differs

    def spec(value):
        return version.get(value, value)

    for node in loop.recomputed + loop.nodes:
        if casts.get(node) is not None:  # loop reads the float32 value, as computed here
            mine = spec(casts[node])
            if node in own:
                points.held[node] = mine
            elif mine is not points.held.get(node, node):
                version[node] = mine
            continue
        if node in casts and node not in own and node in points.held:  # rounded here only
            version[node] = Widened(spec(node.inputs[0]), node.dtype)
            continue
        if not any(i in version for i in node.inputs):
            continue
        if node in own:
            points.reads[node] = {i: version[i] for i in node.inputs if i in version}
        else:
            version[node] = Recomputed(node, tuple(spec(i) for i in node.inputs))
    for red in loop.reductions:
        if any(i in version for i in red.inputs):
            points.reads[red] = {i: version[i] for i in red.inputs if i in version}


def reference_plan(plan: Plan, points: RoundingPoints, sources: dict) -> Plan:
    """plan (the widened plan the reference interpreter runs) computing what the compiled
    loops compute (`Plan.unrounded`, `Plan.reads_instead`); each value they read is freed only
    after its last such read. sources: a node of the lowered graph -> the node of plan it
    computes, where they differ (ir/strided_copies.py)."""
    if not points.held and not points.reads:
        return plan

    def node(value):
        if isinstance(value, Widened):
            return Widened(node(value.of), value.dtype)
        if isinstance(value, Recomputed):
            return Recomputed(node(value.node), tuple(node(i) for i in value.inputs))
        return sources.get(value, value)

    held = {node(c): node(s) for c, s in points.held.items()}
    reads = {node(n): {node(i): node(r) for i, r in rs.items()} for n, rs in points.reads.items()}
    step = {value: index for index, value in enumerate(plan.graph.nodes)}
    freed_at = {v: t for t, values in plan.frees_after.items() for v in values}
    frees = {t: list(values) for t, values in plan.frees_after.items()}
    last_read = dict(plan.last_read)
    late = [(s, step.get(c)) for c, s in held.items()]
    late += [(r, step.get(n)) for n, rs in reads.items() for r in rs.values()]
    for spec, read in late:
        if read is None:  # a node of the lowered graph only (a copy): nothing to keep
            continue
        for value in spec_values(spec):
            last_read[value] = max(last_read.get(value, read), read)
            at = freed_at.get(value)
            if at is not None and at < read:
                frees[at].remove(value)
                frees.setdefault(read, []).append(value)
                freed_at[value] = read
    return replace(
        plan, last_read=last_read, frees_after=frees, unrounded=held, reads_instead=reads
    )


def spec_values(spec) -> list[Value]:
    """The plan's values a spec reads."""
    if isinstance(spec, Widened):
        return spec_values(spec.of)
    if isinstance(spec, Recomputed):
        return [v for i in spec.inputs for v in spec_values(i)]
    return [spec]
