"""A new size of a symbolic plan rendered as a substitution: its literal vector evaluated, not
its driver rendered again.

Every size of one symbolic plan (ir/symbolic.py) runs the first size's driver text with its own
literal vector (codegen/render/lift.py); rendering a size only to lift that vector back was most
of what a new size cost beyond its step (the transformer's 5.8 of ~12 ms, BENCHMARKS.md 31). A
size rendered once more with the lowered plan's numbers traced (codegen/render/traced_numbers.py:
every shape dim, attribute number, loop size, arena offset and length a leaf `L[i]`) gives a
Recipe: each literal's expression over the leaves, and the guards that held while rendering
(every comparison and truth test the rendering made of a number). A later size whose lowered
plan has the same structure (Recipe.key: kernels, row runs, buffers, arena placement as value
positions) and whose leaves pass every guard took every branch the recorded size took, so its
driver is that driver and its literals are the expressions evaluated: the same module, byte for
byte, a fresh rendering makes (tests/test_substitution.py). Where a guard fails, the size is
rendered as before (and recorded, up to RECIPES_KEPT recipes a plan).

A recipe is made only where the traced rendering reproduces the recorded size's rendering
exactly (its driver code, its integer and float literals); anything the tracing cannot follow
(codegen/render/traced_numbers.Untraceable, or any other error) leaves the plan without one.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from dataclasses import dataclass

from backplan.codegen.build import loop_calls
from backplan.codegen.flags import flags_text
from backplan.codegen.render.choices import pinned
from backplan.codegen.render.kernel_source import KernelSource
from backplan.codegen.render.lift import FLOATS, INTS, _sizeless
from backplan.codegen.render.plain_literals import plain_literals
from backplan.codegen.render.traced_numbers import MARK, Traced, recording
from backplan.ir.fusion import Kernel
from backplan.ir.graph import Graph, Value
from backplan.ir.layout import BufferLayout
from backplan.ir.lowering import LoweredPlan, literal_outputs
from backplan.ir.types import TensorType

RECIPES_KEPT = 3  # recipes a symbolic plan keeps (a size whose guards fail records another)


@dataclass
class Recipe:
    key: tuple  # the lowered structure the recorded size had (structure_key)
    guards: object  # L -> whether every guard holds
    literals: object  # L -> (ints, floats)
    arguments: object  # L -> each loop kernel's arguments (KernelSource.arguments)
    # the recorded size's GeneratedModule with its per-node facts (epilogues_apart, calls_of,
    # gemms) by value position and no layout: a recipe holds none of that size's graph
    generated: object
    guard_texts: list  # each guard, for telling which one a size fails
    environment: tuple = ()  # what the code depends on beside the plan (_environment)


def _environment() -> tuple:
    """What a rendering reads of the process (how drivers call loops, fastmath and threads):
    a recipe applies only where it is what it was."""
    return (loop_calls.mode(), flags_text())


def structure_key(lowered: LoweredPlan) -> tuple | None:
    """What a rendering reads of a lowered plan apart from its numbers, by value positions
    (None where a kernel names a value outside the graph)."""
    graph = lowered.plan.graph
    position = {v: i for i, v in enumerate(graph.inputs + graph.nodes)}
    try:
        return _key(lowered, position)
    except KeyError:
        return None


def _key(lowered: LoweredPlan, at: dict) -> tuple:
    layout = lowered.layout
    graph = lowered.plan.graph
    return (
        len(at),
        tuple(at[o] for o in graph.outputs),
        tuple(_kernel_key(k, at) for k in lowered.kernels),
        tuple(lowered.row_runs),
        frozenset(at[v] for v in lowered.materialized),
        tuple(at[v] for v in layout.outputs),
        tuple(layout.scratch_elements),
        tuple((at[v], at[s]) for v, s in layout.reused_saved.items()),
        tuple(at[v] for v in layout.scratch_offsets),
        tuple(at[v] for v in layout.row_local),
        tuple(at[v] for v in layout.workspaces),
        lowered.origin is None,
    )


def _kernel_key(kernel: Kernel, at: dict) -> tuple:
    return (
        kernel.kind,
        len(kernel.shape),
        tuple(at[n] for n in kernel.nodes),
        tuple(at[n] for n in kernel.reductions),
        tuple(at[n] for n in kernel.recomputed),
        None if kernel.epilogue is None else _kernel_key(kernel.epilogue, at),
    )


def leaves(lowered: LoweredPlan) -> tuple[list, list]:
    """The lowered plan's numbers in the order record() traces them, and the attributes'
    numbers it does not trace (which a size must share with the recorded one)."""
    out: list = []
    fixed: list = []
    graph = lowered.plan.graph
    for v in graph.inputs + graph.nodes:
        out += v.type.shape
        if v.attrs:
            _attr_numbers(v.attrs, out, fixed)
    for kernel in lowered.kernels:
        _kernel_numbers(kernel, out)
    layout = lowered.layout
    out += layout.scratch_elements.values()
    out += layout.scratch_offsets.values()
    out += layout.row_local.values()
    for offset, elements in layout.workspaces.values():
        out += (offset, elements)
    return out, fixed


def _kernel_numbers(kernel: Kernel, out: list) -> None:
    out += kernel.shape
    if kernel.epilogue is not None:
        _kernel_numbers(kernel.epilogue, out)


def _is_number(x) -> bool:
    return (type(x) is int or type(x) is float) and x == x and abs(x) != float("inf")


# Attributes whose numbers a symbolic plan's sizes change (ir/symbolic.py fits shapes, bounds
# and a mean's scale) are traced; every other attribute's numbers (axes, permutations) are part
# of the structure key: a size where one differs renders afresh.
TRACED_ATTRS = frozenset(
    {"shape", "input_shape", "value", "start", "stop", "starts", "stops", "begin", "end"}
)


def _attr_numbers(attrs: dict, out: list, fixed: list) -> None:
    for name, x in attrs.items():
        _numbers_of(x, out if name in TRACED_ATTRS else fixed)


def _numbers_of(x, out: list) -> None:
    if _is_number(x):
        out.append(x)
    elif isinstance(x, tuple | list):
        for item in x:
            _numbers_of(item, out)
    elif isinstance(x, dict):
        for item in x.values():
            _numbers_of(item, out)


class _Tracer:
    """Makes the traced copy of a lowered plan, leaf by leaf in leaves()' order."""

    def __init__(self):
        self.count = 0

    def leaf(self, x):
        traced = Traced(f"L[{self.count}]", x)
        self.count += 1
        return traced

    def attrs(self, attrs: dict) -> dict:
        return {k: self.numbers(x) if k in TRACED_ATTRS else x for k, x in attrs.items()}

    def numbers(self, value):
        if isinstance(value, dict):
            return {k: self.numbers(v) for k, v in value.items()}
        if isinstance(value, tuple | list):
            return type(value)(self.numbers(v) for v in value)
        return self.leaf(value) if _is_number(value) else value

    def kernel(self, kernel: Kernel, new: dict) -> Kernel:
        shape = tuple(self.leaf(d) for d in kernel.shape)
        epilogue = None if kernel.epilogue is None else self.kernel(kernel.epilogue, new)
        return Kernel(
            kernel.kind,
            [new[n] for n in kernel.nodes],
            shape,
            [new[n] for n in kernel.reductions],
            [new[n] for n in kernel.recomputed],
            epilogue,
        )


def traced_copy(lowered: LoweredPlan) -> tuple[LoweredPlan, int]:
    """A copy of the lowered plan whose numbers are Traced leaves (and how many), sharing
    nothing the copy changes with the plan."""
    tracer = _Tracer()
    graph = lowered.plan.graph
    new: dict[Value, Value] = {}
    for v in graph.inputs + graph.nodes:
        shape = tuple(tracer.leaf(d) for d in v.type.shape)
        attrs = tracer.attrs(v.attrs) if v.attrs else v.attrs
        made = Value(v.op, [new[i] for i in v.inputs], attrs, TensorType(v.dtype, shape), v.loc)
        made.role = v.role
        new[v] = made
    copied = Graph(name=graph.name, constants=graph.constants)
    copied.inputs = [new[v] for v in graph.inputs]
    copied.nodes = [new[v] for v in graph.nodes]
    copied.outputs = [new[v] for v in graph.outputs]
    kernels = [tracer.kernel(k, new) for k in lowered.kernels]
    layout = lowered.layout
    traced_layout = BufferLayout(
        outputs=[new[v] for v in layout.outputs],
        scratch_elements={d: tracer.leaf(n) for d, n in layout.scratch_elements.items()},
        reused_saved={new[v]: new[s] for v, s in layout.reused_saved.items()},
        scratch_offsets={new[v]: tracer.leaf(o) for v, o in layout.scratch_offsets.items()},
        row_local={new[v]: tracer.leaf(r) for v, r in layout.row_local.items()},
        workspaces={
            new[v]: (tracer.leaf(o), tracer.leaf(n)) for v, (o, n) in layout.workspaces.items()
        },
    )
    plan = copy.copy(lowered.plan)
    plan.graph, plan.shared = copied, None
    traced = copy.copy(lowered)
    traced.plan, traced.kernels, traced.layout = plan, kernels, traced_layout
    traced.materialized = {new[v] for v in lowered.materialized}
    traced.buffers = [new[v] for v in lowered.buffers]
    traced.origin, traced.rendered, traced.interpreted = None, None, None
    return traced, tracer.count


# a marker (codegen/render/traced_numbers.MARK + index), or any other numeric literal
_NUMBER = re.compile(
    r"""("(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')|(#[^\n]*)"""
    r"|(?<![\w.])((?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?)(?![\w.])"
)


_MARKER = re.compile(rf"{str(MARK)[0]}\d{{{len(str(MARK)) - 1}}}(?:\.0)?")


def lift_traced(body: list[str], made) -> tuple[list[str], list[str], list[str]]:
    """lift.lift_literals of a traced rendering's body (`made` its Recording): each literal's
    expression text (a marker's expression, any other number as itself) instead of its value;
    a marker inside a string (an error message's class count) its value, guarded."""
    marked = made.marked
    ints: list[str] = []
    floats: list[str] = []

    def pinned(match) -> str:
        number = marked[int(match.group().removesuffix(".0")) - MARK]
        made.guard(f"({number.text}=={number.value!r})")
        return str(number.value)

    parts = _NUMBER.split("\n".join(body))
    for k in range(3, len(parts), 4):
        number = parts[k]
        if number is None:
            string = parts[k - 2]
            if string is not None:
                parts[k] = _MARKER.sub(pinned, string)
            else:
                parts[k] = _sizeless(parts[k - 1])
        else:
            text = number
            whole = number.removesuffix(".0")
            if whole.isdigit() and int(whole) >= MARK:
                text = marked[int(whole) - MARK].text
            if number.isdigit():
                parts[k] = f"{INTS}[{len(ints)}]"
                ints.append(text)
            else:
                parts[k] = f"{FLOATS}[{len(floats)}]"
                floats.append(text if text.startswith("float(") else f"float({text})")
        parts[k - 2] = parts[k - 1] = ""
    return "".join(parts).split("\n"), ints, floats


def record(lowered: LoweredPlan, generated, choices: dict) -> Recipe | None:
    """The recipe of this size's rendering (`generated`, just made), or None where the traced
    rendering does not reproduce it."""
    from backplan.codegen.render.emit import driver_code, rendered_body  # emit imports this

    key = structure_key(lowered)
    if key is None or generated.literals is None or generated.code is None:
        raise NoRecipe("a kernel reads a value outside the graph, or the driver is not lifted")
    traced, count = traced_copy(lowered)
    with recording() as made, pinned(dict(choices)):
        rendered = rendered_body(traced, False, None)
        body, ints, floats = lift_traced(rendered.body, made)
        params = rendered.params + [INTS, FLOATS]
        if loop_calls.mode() == "address":
            body = plain_literals(body)
        kernel_lines = rendered.kernel_lines()
    graph = lowered.plan.graph
    code = driver_code({}, graph.name, kernel_lines, params, body)
    if code != generated.code:
        differ = (
            next((a, b) for a, b in zip(code, generated.code, strict=False) if a != b)
            if len(code) == len(generated.code)
            else (len(code), len(generated.code))
        )
        raise NoRecipe(f"the traced rendering's driver differs: {differ}")
    arguments = _function(_arguments_text(rendered.emitter.kernels.values(), made.marked))
    # each distinct guard once, those naming no leaf (true at every size) left out
    kept = [g for g in dict.fromkeys(made.guards) if "L[" in g]
    guards = _function(" and ".join(kept) or "True")
    literals = _function(f"([{', '.join(ints)}], [{', '.join(floats)}])")
    numbers, fixed = leaves(lowered)
    if len(numbers) != count or not guards(numbers):
        raise NoRecipe("the guards do not hold at the size recorded")
    if literals(numbers) != tuple(generated.literals):
        raise NoRecipe("the literals evaluated differ from the size's own")
    if arguments(numbers) != [k.arguments for k in generated.loop_kernels]:
        raise NoRecipe("the loop kernels' arguments evaluated differ from the size's own")
    at = {v: i for i, v in enumerate(graph.inputs + graph.nodes)}
    kept_module = dataclasses.replace(
        generated,
        output_buffers=[],
        literal_outputs={},
        output_sources=[],
        layout=None,
        epilogues_apart=frozenset(at[n] for n in generated.epilogues_apart),
        calls_of={at[n]: count for n, count in generated.calls_of.items()},
        gemms={at[n]: text for n, text in generated.gemms.items()},
    )
    return Recipe((key, fixed), guards, literals, arguments, kept_module, kept, _environment())


def _arguments_text(kernels, marked: list) -> str:
    """The expression of each kernel's arguments (texts like `np.intp(3968)`) as f-strings of
    the leaves."""

    def field(match) -> str:
        text = match.group()
        number = marked[int(text.removesuffix(".0")) - MARK]
        return f"{{{number.text}!r}}" if text.endswith(".0") else f"{{{number.text}}}"

    def argument(text: str) -> str:
        escaped = text.replace("{", "{{").replace("}", "}}")
        return "f" + repr(_MARKER.sub(field, escaped))

    return (
        "["
        + ", ".join(f"({''.join(argument(a) + ', ' for a in k.arguments)})" for k in kernels)
        + "]"
    )


def _function(expression: str):
    """A function of the leaves L evaluating `expression` (one compiled function, not one
    eval per literal)."""
    namespace: dict = {}
    exec(f"def f(L):\n    return {expression}\n", namespace)  # noqa: S102 (our own text)
    return namespace["f"]


def apply(recipe: Recipe, lowered: LoweredPlan):
    """The GeneratedModule a fresh rendering of `lowered` would make, or None where the
    recipe's structure or one of its guards does not hold at its size."""
    from backplan.codegen.render.emit import GeneratedModule, _output_sources  # emit imports this

    if _environment() != recipe.environment:
        return None
    key = structure_key(lowered)
    numbers, fixed = leaves(lowered)
    if (key, fixed) != recipe.key or not recipe.guards(numbers):
        return None
    ints, floats = recipe.literals(numbers)
    made = recipe.generated
    graph = lowered.plan.graph
    values = graph.inputs + graph.nodes
    layout = lowered.layout
    literal_outs = literal_outputs(lowered)
    return GeneratedModule(
        made.source,
        made.constant_names,
        dict(sorted(layout.scratch_elements.items())),
        list(layout.outputs),
        literal_outs,
        _output_sources(graph.outputs, literal_outs, layout.outputs),
        made.kernel_count,
        layout,
        [
            KernelSource(k.digest, k.source, k.parallel, arguments)
            for k, arguments in zip(made.loop_kernels, recipe.arguments(numbers), strict=True)
        ],
        made.driver_statements,
        made.driver_parts,
        (ints, floats),
        frozenset(values[i] for i in made.epilogues_apart),
        {values[i]: count for i, count in made.calls_of.items()},
        {values[i]: text for i, text in made.gemms.items()},
        made.code,
    )


class NoRecipe(Exception):
    """Why a size's traced rendering gives no recipe."""


def recorded(lowered: LoweredPlan, generated, choices: dict, refused: list) -> Recipe | None:
    """record(), None where the traced rendering fails in any way (the size rendered as
    before; no recipe is kept), why appended to refused."""
    try:
        return record(lowered, generated, choices)
    except Exception as exc:  # noqa: BLE001 (a recipe is an optimisation, never an error)
        refused.append(f"{type(exc).__name__}: {exc}"[:500])
        return None
