"""Plans whose sizes on one axis are a symbol (a dynamic batch): the same plan traced at three
sizes, compared node by node, becomes one plan whose shapes, shape attributes and size-derived
constants are formulas of the symbol, instantiated at any size without tracing again.

Every number that differs between the three plans must be `a + c·batch` with integer a and c
(a shape, a reshape's target, a broadcast's shape) or `1 / (a + c·batch)` (the scale of a mean);
anything else (a different op, another constant, a size that is not a formula) is a
SymbolicError whose message names the op and the user's line, and the caller plans each size
on its own instead. Sizes 0 and 1 are never the symbol (a size-1 axis broadcasts)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np

from .errors import BackplanError
from .graph import Graph, Value, carry_reasons
from .liveness import Plan
from .lowering import group_ahead
from .printer import format_loc
from .registry import get_op
from .types import TensorType


class SymbolicError(Exception):
    """The plan cannot be one formula of the symbol; the message says where and why."""


@dataclass(frozen=True)
class Affine:
    """a + c·symbol, an integer at every size."""

    a: int
    c: int

    def at(self, n: int) -> int:
        return self.a + self.c * n

    def text(self, symbol: str) -> str:
        term = symbol if self.c == 1 else f"{self.c:,}·{symbol}"
        if self.a == 0:
            return term
        sign = "-" if self.a < 0 else "+"
        return f"{abs(self.a):,} {sign} {term}" if self.a > 0 else f"{term} {sign} {-self.a:,}"


@dataclass(frozen=True)
class Reciprocal:
    """1 / (a + c·symbol): a mean's scale over a symbolic axis."""

    count: Affine

    def at(self, n: int) -> float:
        return 1.0 / self.count.at(n)


def is_formula(value) -> bool:
    return isinstance(value, Affine | Reciprocal)


def evaluate(value, n: int):
    """A fitted attribute (formulas inside tuples, lists and dicts) at size n."""
    if is_formula(value):
        return value.at(n)
    if isinstance(value, tuple):
        return tuple(evaluate(v, n) for v in value)
    if isinstance(value, list):
        return [evaluate(v, n) for v in value]
    if isinstance(value, dict):
        return {k: evaluate(v, n) for k, v in value.items()}
    return value


def fit_number(values: list, sizes: list[int], where: str):
    """The constant or formula that gives values[i] at sizes[i]."""
    first = values[0]
    if all(type(v) is type(first) and v == first for v in values):
        return first
    if all(type(v) is int for v in values):
        c, rest = divmod(values[1] - values[0], sizes[1] - sizes[0])
        affine = Affine(values[0] - c * sizes[0], c)
        if rest == 0 and all(affine.at(n) == v for n, v in zip(sizes, values, strict=True)):
            return affine
    if all(type(v) is float and v != 0.0 for v in values):
        counts = [round(1.0 / v) for v in values]
        fitted = fit_number(counts, sizes, where)
        if isinstance(fitted, Affine):
            reciprocal = Reciprocal(fitted)
            if all(reciprocal.at(n) == v for n, v in zip(sizes, values, strict=True)):
                return reciprocal
    seen = ", ".join(f"{v!r} at size {n}" for n, v in zip(sizes, values, strict=True))
    raise SymbolicError(f"{where} is {seen}: not a + c·size nor its reciprocal")


def fit_attr(values: list, sizes: list[int], where: str):
    """Walk equal structures in step; numbers that differ become formulas."""
    first = values[0]
    if isinstance(first, tuple | list) and not isinstance(first, str):
        if any(type(v) is not type(first) or len(v) != len(first) for v in values):
            raise SymbolicError(f"{where} changes length with the size")
        items = [fit_attr([v[i] for v in values], sizes, where) for i in range(len(first))]
        return type(first)(items)
    if isinstance(first, dict):
        if any(not isinstance(v, dict) or v.keys() != first.keys() for v in values):
            raise SymbolicError(f"{where} changes its attributes with the size")
        return {k: fit_attr([v[k] for v in values], sizes, f"{where} {k}") for k in first}
    if isinstance(first, int | float) and not isinstance(first, bool):
        return fit_number(values, sizes, where)
    if any(type(v) is not type(first) or v != first for v in values):
        raise SymbolicError(f"{where} is {values[0]!r} at one size, {values[1]!r} at another")
    return first


def _where(node: Value) -> str:
    place = f" at {format_loc(node.loc)}" if node.loc else ""
    return f"{node.op}{place}"


@dataclass
class SymbolicGraph:
    """A graph (the one traced at sizes[0]) with formulas for what changes with the size."""

    template: Graph
    shapes: dict[int, tuple]  # position in inputs + nodes -> shape with formulas
    attrs: dict[int, dict]  # node position -> attrs with formulas (only nodes that vary)
    # per position in shapes: (it, the first position of its dtype and shape); see _types_at
    _classes: list | None = field(default=None, init=False, repr=False, compare=False)

    def at(self, n: int) -> tuple[Graph, dict[Value, Value]]:
        """The graph at size n and the map from the template's values to its values."""
        graph = self.template
        new = Graph(name=graph.name, constants=dict(graph.constants))
        mapping: dict[Value, Value] = {}
        types = self._types_at(n)
        for i, inp in enumerate(graph.inputs):
            mapping[inp] = new.add_input(
                types.get(i, inp.type), role=inp.role or "arg", loc=inp.loc
            )
        base = len(graph.inputs)
        for j, node in enumerate(graph.nodes):
            attrs = evaluate(self.attrs[j], n) if j in self.attrs else node.attrs
            value = Value(
                node.op,
                [mapping[i] for i in node.inputs],
                attrs,
                types.get(base + j, node.type),
                node.loc,
            )
            if node.op in BOUNDED_OPS:
                _check_bounds(value, n)
            mapping[node] = value
            new.nodes.append(value)
        new.outputs = [mapping[o] for o in graph.outputs]
        return carry_reasons(graph, new, mapping), mapping

    def _types_at(self, n: int) -> dict[int, TensorType]:
        """Each position whose shape is a formula -> its type at size n: one TensorType per
        distinct (dtype, formula shape), shared as a traced graph's values share theirs (a
        transformer's 155 such values have 10; each type works its bytes out once)."""
        classes = self._classes
        if classes is None:
            values = self.template.inputs + self.template.nodes
            first: dict = {}
            classes = self._classes = [
                (p, first.setdefault((values[p].dtype, shape), (p, values[p])))
                for p, shape in self.shapes.items()
            ]
        made: dict = {}
        types = {}
        for p, (q, value) in classes:
            found = made.get(q)
            if found is None:
                found = made[q] = self._type(q, value, n)
            types[p] = found
        return types

    def _type(self, position: int, value: Value, n: int) -> TensorType:
        shape = self.shapes.get(position)
        if shape is None:
            return value.type
        # a shape: ints and formulas (evaluate's walk cost an unrolled LSTM's size ~1 ms)
        return TensorType(
            value.dtype,
            tuple(
                d if type(d) is int else d.a + d.c * n if type(d) is Affine else evaluate(d, n)
                for d in shape
            ),
        )


BOUNDED_OPS = frozenset({"slice", "pad_slice"})  # constant bounds fitted at sizes >= the first


def _check_bounds(value: Value, n: int) -> None:
    """A slice's bounds fitted at three sizes (`x[:4]`, `x[3]`, `x[-4:]` on the symbol's axis)
    may fall outside a smaller size's axis, where the plan would read past the argument: such
    a size is planned on its own (traced as eager runs it: clamped, or the IndexError)."""
    try:
        fits = get_op(value.op).infer([i.type for i in value.inputs], value.attrs) == value.type
    except BackplanError as exc:
        raise SymbolicError(f"{_where(value)} at size {n}: {exc}") from None
    if not fits:
        raise SymbolicError(f"{_where(value)} at size {n}: its bounds give another shape")
    a = value.attrs  # a slice's axis of the operand; pad_slice's of its output
    dims = value.inputs[0].shape if value.op == "slice" else a["shape"]
    for dim, start, stop, step in zip(dims, a["starts"], a["stops"], a["steps"], strict=True):
        count = len(range(start, stop, step))  # x[4::-1] of 4 rows: 0 <= 4 <= 4, 5 rows, row 4
        if count and not (0 <= start < dim and 0 <= start + (count - 1) * step < dim):
            raise SymbolicError(
                f"{_where(value)} at size {n}: slice {start}:{stop}:{step} leaves an axis of "
                f"size {dim}"
            )


def fit_graphs(graphs: list[Graph], sizes: list[int]) -> SymbolicGraph:
    """One SymbolicGraph from the same function's graphs at `sizes` (at least three)."""
    first = graphs[0]
    for other in graphs[1:]:
        _same_structure(first, other)
    values = [g.inputs + g.nodes for g in graphs]
    shapes: dict[int, tuple] = {}
    for position, tied in enumerate(zip(*values, strict=True)):
        where = _where(tied[0]) if tied[0].op != "input" else f"input {position}"
        if any(v.dtype != tied[0].dtype for v in tied):
            raise SymbolicError(f"{where} changes dtype with the size")
        shape = fit_attr([v.shape for v in tied], sizes, f"the shape of {where}")
        if shape != tied[0].shape:
            shapes[position] = shape
    attrs: dict[int, dict] = {}
    for j, tied in enumerate(zip(*[g.nodes for g in graphs], strict=True)):
        fitted = fit_attr([v.attrs for v in tied], sizes, _where(tied[0]))
        if fitted != tied[0].attrs:
            attrs[j] = fitted
    return SymbolicGraph(first, shapes, attrs)


def _same_structure(a: Graph, b: Graph) -> None:
    """Same ops reading the same operands, same outputs and constants, in the same order."""
    if len(a.inputs) != len(b.inputs) or len(a.nodes) != len(b.nodes):
        raise SymbolicError(
            f"@{a.name} has {len(a.nodes)} steps at one size and {len(b.nodes)} at another "
            "(the function takes another path at another size)"
        )
    index_a = {v: i for i, v in enumerate(a.inputs + a.nodes)}
    index_b = {v: i for i, v in enumerate(b.inputs + b.nodes)}
    for x, y in zip(a.nodes, b.nodes, strict=True):
        inputs_a = [index_a[v] for v in x.inputs]
        if x.op != y.op or inputs_a != [index_b[v] for v in y.inputs]:
            raise SymbolicError(
                f"{_where(x)} is {y.op} on other operands at another size "
                "(the function takes another path at another size)"
            )
    if [index_a[v] for v in a.outputs] != [index_b[v] for v in b.outputs]:
        raise SymbolicError(f"@{a.name} returns other values at another size")
    if a.constants.keys() != b.constants.keys() or not all(
        _same_array(a.constants[k], b.constants[k]) for k in a.constants
    ):
        raise SymbolicError(
            f"@{a.name} holds constant arrays that change with the size (an array made from "
            "the size, e.g. np.arange(x.shape[0]))"
        )


def _same_array(x: np.ndarray, y: np.ndarray) -> bool:
    return x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y, equal_nan=True)


@dataclass
class SymbolicPlan:
    """A plan (graph in schedule order plus frees) whose sizes are formulas of the symbol."""

    graph: SymbolicGraph
    plan: Plan  # the template: the plan at the first size
    shared: dict = field(default_factory=dict)  # Plan.shared of every instantiated plan

    def at(self, n: int) -> tuple[Plan, dict[Value, Value]]:
        graph, mapping = self.graph.at(n)
        plan = self.plan
        return (
            Plan(
                graph,
                {mapping[v]: s for v, s in plan.first_write.items()},
                {mapping[v]: s for v, s in plan.last_read.items()},
                {s: [mapping[v] for v in vs] for s, vs in plan.frees_after.items()},
                donated=plan.donated,
                shared=self.shared,
                copied=plan.copied,
            ),
            mapping,
        )


def fit_plans(plans: list[Plan], sizes: list[int]) -> SymbolicPlan:
    """The plans of one function at three sizes as one SymbolicPlan, or SymbolicError."""
    graphs = [p.graph for p in plans]
    symbolic = fit_graphs(graphs, sizes)
    steps = [{s: sorted(_positions(p.graph, vs)) for s, vs in p.frees_after.items()} for p in plans]
    if any(s != steps[0] for s in steps[1:]):
        raise SymbolicError(f"@{graphs[0].name} frees its buffers at other steps at another size")
    symbolic_plan = SymbolicPlan(symbolic, plans[0])
    plans[0].shared = symbolic_plan.shared  # the first size runs the same driver
    symbolic_plan.shared["first"] = weakref.ref(plans[0])  # keeps its lowering (let_go)
    for probe in plans[1:]:  # its grouping, for new sizes unlike the first (ir/grouping_reuse.py)
        group_ahead(probe, symbolic_plan.shared)
    plans[0].lowered.clear()  # rendered again, size-generic, if it was rendered already
    return symbolic_plan


def _positions(graph: Graph, values) -> list[int]:
    index = {v: i for i, v in enumerate(graph.inputs + graph.nodes)}
    return [index[v] for v in values]
