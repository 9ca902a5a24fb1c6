"""A new size of a symbolic plan takes the kernel grouping of a size already lowered, when
nothing the grouping asks of the sizes differs between the two.

Fusion (ir/fusion.py: group_kernels, materialized), epilogue absorption (ir/epilogue.py) and
the row runs (ir/lowering.py: row_runs) read a graph's sizes only through these questions:
- is a dim 0, 1 or more (`d != 1` of index maps, `shape[0] < 2`, `shape[1] > 1`), and how
  many axes a shape has: each value's unit pattern (0, 1 or 2 for "more", per dim);
- are two shapes equal (loops of one iteration shape, `kernel.shape == shape`, a GEMM's and
  its epilogue loop's shapes): each value's shape class (its shape's first place among the
  graph's distinct shapes);
- do two row loops run over as many rows (`shape[0] != rows`): each 2-D value's row class
  (its first dim's first place among the 2-D shapes' first dims);
- does a reshape only add or drop unit axes (its non-unit dims against its input's): the
  answer itself, per reshape;
- with 16-bit values widened (ir/widen.py), does a widening's dim equal a loop's dim or 1
  (`d in (1, t)`): then every dim's class (its first place among the distinct dims).
Beside those they read ops, operands, dtypes, reductions' axes, whether a widened graph's
node has an origin and the registry. `grouping_key` writes every one of those down: two
graphs with equal keys answer every question alike, so they group node for node alike, and
a key that differs (a size of 1, a size at which two shapes meet) is grouped afresh. The
shape classes also give each kernel's shape at the new size.

What is reused: the kernels (after epilogues), the values that need a buffer and the row
runs. The layout is not: it places bytes, which change with every size.
"""

from __future__ import annotations

from dataclasses import dataclass

from .fusion import NONE_HELD, Kernel, is_unit_reshape
from .graph import Graph
from .registry import REGISTRY, get_op

KEPT = 6  # groupings kept per symbolic plan (the first size's, two probes', a size of 1...)


@dataclass
class Grouping:
    """A lowered size's grouping, written by value positions (graph.inputs + graph.nodes)
    and shape classes, so that another size's graph of the same key reads it back."""

    key: tuple
    kernels: list  # one tuple per kernel (_write)
    needed: tuple[int, ...]  # positions of the values that need a buffer
    runs: tuple[tuple[int, int], ...]


def grouping_key(graph: Graph, origin: dict | None) -> tuple[tuple, list[tuple]]:
    """(key, shapes): everything the grouping reads of the graph, and the shape of each
    shape class (shapes[c] is class c's shape at this graph's size). The key is one flat
    tuple of ints, strings, booleans and None, each variable-length part led by its length
    (a tuple of atoms: the cyclic collector stops tracking it at its first look)."""
    shapes: dict[tuple, int] = {}
    rows: dict[int, int] = {}
    dims: dict[int, int] | None = {} if origin is not None else None
    position: dict = {}
    key: list = [dims is not None]
    add, extend = key.append, key.extend
    for value in [*graph.inputs, *graph.nodes]:
        position[value] = len(position)
        op, shape = value.op, value.shape
        add(op)
        add(value.dtype)
        add(shapes.setdefault(shape, len(shapes)))
        add(len(shape))
        extend([d if d < 2 else 2 for d in shape])  # 0, 1 or more
        add(rows.setdefault(shape[0], len(rows)) if len(shape) == 2 else None)
        if dims is not None:
            extend([dims.setdefault(d, len(dims)) for d in shape])
            add(value in origin)
        if op == "input":
            continue
        inputs = value.inputs
        add(len(inputs))
        extend([position[i] for i in inputs])
        if op == "reshape":
            add(is_unit_reshape(value))
        elif (REGISTRY.get(op) or get_op(op)).loop_tail:
            axes = value.attrs.get("axes")
            add(None if axes is None else len(axes))
            extend(axes or ())
    add(len(graph.outputs))
    extend([position[o] for o in graph.outputs])
    return tuple(key), list(shapes)


def written(key: tuple, graph: Graph, kernels: list[Kernel], needed, runs, shapes):
    """The grouping just computed for graph, to be read back at another size (None where a
    kernel holds a value or a shape the graph does not: nothing is kept then)."""
    position = {v: i for i, v in enumerate(graph.inputs + graph.nodes)}
    classes = {shape: c for c, shape in enumerate(shapes)}
    try:
        return Grouping(
            key,
            [_write(k, position, classes) for k in kernels],
            sorted(position[v] for v in needed),
            list(runs),
        )
    except KeyError:
        return None


def read_back(grouping: Grouping, graph: Graph, shapes: list[tuple]):
    """(kernels, needed, runs) of graph, whose key equals grouping.key."""
    values = graph.inputs + graph.nodes
    kernels = [_read(w, values, shapes) for w in grouping.kernels]
    return kernels, {values[p] for p in grouping.needed}, list(grouping.runs)


def find(kept: list[Grouping], key: tuple) -> Grouping | None:
    for grouping in kept:
        if grouping.key == key:
            return grouping
    return None


def _write(kernel: Kernel, position: dict, classes: dict) -> tuple:
    epilogue = kernel.epilogue
    return (
        kernel.kind,
        tuple([position[n] for n in kernel.nodes]),
        classes[tuple(kernel.shape)],
        tuple([position[n] for n in kernel.reductions]),
        tuple([position[n] for n in kernel.recomputed]),
        None if epilogue is None else _write(epilogue, position, classes),
    )


def _read(written_kernel: tuple, values: list, shapes: list[tuple]) -> Kernel:
    kind, nodes, shape, reductions, recomputed, epilogue = written_kernel
    return Kernel(
        kind,
        [values[p] for p in nodes],
        shapes[shape],
        [values[p] for p in reductions] if reductions else NONE_HELD,
        [values[p] for p in recomputed] if recomputed else NONE_HELD,
        None if epilogue is None else _read(epilogue, values, shapes),
    )
