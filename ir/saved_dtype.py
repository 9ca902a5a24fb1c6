"""Saved buffers stored in a narrower dtype (`bp.compile(fn, saved_dtype=bp.bfloat16)`): the
forward rounds each float32 or float64 value it saves for backward to that dtype once (round to
nearest even), the backward reads it back widened. Half the bytes held between forward and
backward for bfloat16; no added FLOPs beyond one cast each way, and a rounding of what the
derivative reads (bfloat16 keeps 8 significant bits). Your own inputs that backward reads are
held by reference, not copied, so they stay as they are; so do saved user outputs (a narrow
copy would add to what is held, not replace it).

The joint plan of value_and_grad (`narrowed_joint`) does the same to the values its gradient
part reads from its forward part: the narrowing cast runs right after the value is made (a
forward node: `is_saved_narrowing`), the widening cast just before the first gradient reader
(in compiled plans ir/widen.py moves it into its readers: a matmul reads the bfloat16 value
as it is, a fused loop widens it as it reads).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .graph import Graph, Value, copy_graph
from .types import TensorType, is_float, np_dtype


@dataclass(frozen=True)
class HeldNarrowing:
    """What saved_dtype did to a plan whose gradient part reads forward values (ir/pipeline.py
    narrowed_for_peak): of `offered` held values it could keep in dtype, `narrowed` are (the
    others stay in full precision), so the compiled plan peaks at `peak` bytes against
    `full_peak` with none narrowed and `narrowed_peak` at best with some; left_wide_bytes:
    what the values left in full precision hold beyond narrow copies of them."""

    dtype: str
    offered: int
    narrowed: int
    peak: int
    full_peak: int
    narrowed_peak: int
    left_wide_bytes: int = 0
    # with none narrowed, the narrowed plans (explain words their peak as it counts peaks)
    alternative: object = field(default=None, compare=False, repr=False)


def narrowed_saved(
    forward: Graph, backward: Graph, slots: list, n_outputs: int, dtype: str
) -> tuple[Graph, Graph, list]:
    """(forward, backward, slots) with the saved values the forward computes stored in dtype.
    forward's lists are the caller's own (they are changed); backward is copied."""
    first_saved = len(backward.inputs) - len(slots)
    backward, _ = copy_graph(backward)
    slots, narrowed = list(slots), {}
    for k, slot in enumerate(slots):
        kind, at = slot.source
        if kind != "output" or at < n_outputs:
            continue
        if at not in narrowed:
            value = forward.outputs[at]
            if not _narrows(value.dtype, dtype):
                continue
            type_ = TensorType(dtype, value.shape)
            narrowed[at] = Value("astype", (value,), {"dtype": dtype}, type_, value.loc)
            forward.nodes.append(narrowed[at])
            forward.outputs[at] = narrowed[at]
        slots[k] = replace(slot, forward=narrowed[at])
        _read_widened(backward, backward.inputs[first_saved + k], dtype)
    return forward, backward, slots


def narrowed_joint(
    graph: Graph,
    forward: set[Value],
    held: list[Value],
    dtype: str,
    moved: dict | None = None,
    stored: set[Value] | None = None,
) -> Graph:
    """A copy of the joint plan's graph whose held values (forward values its gradient part
    reads; `forward` and `held` as ir/remat.py finds them) are kept in dtype between the two
    parts. Inputs and the user's outputs are held as they are, and so is a held value not in
    `stored` (when given: the values the compiled plan in full precision keeps in a buffer),
    which never reaches memory: a narrow copy of it would be a buffer where there was none.
    `moved`, when given, gets each node of graph -> its copy."""
    chosen = narrowable(graph, held, dtype, stored)
    if not chosen:
        return graph
    graph, mapping = copy_graph(graph)
    if moved is not None:
        moved.update(mapping)
    forward = {mapping[v] for v in forward}
    for value in (mapping[v] for v in chosen):
        narrow = Value(
            "astype", (value,), {"dtype": dtype}, TensorType(dtype, value.shape), value.loc
        )
        graph.nodes.insert(graph.nodes.index(value) + 1, narrow)
        forward.add(narrow)
        wide = Value("astype", (narrow,), {"dtype": value.dtype}, value.type, value.loc)
        readers = [n for n in graph.nodes if n not in forward and value in n.inputs]
        for node in readers:
            node.inputs = tuple(wide if i is value else i for i in node.inputs)
        graph.nodes.insert(graph.nodes.index(readers[0]), wide)
    return graph


def narrowable(
    graph: Graph, held: list[Value], dtype: str, stored: set[Value] | None = None
) -> list[Value]:
    """The held values narrowed_joint keeps in dtype: float values wider than it, not the
    plan's inputs or outputs, and (with `stored`) only those in it."""
    kept_as_is = set(graph.inputs) | set(graph.outputs)
    return [
        v
        for v in held
        if v not in kept_as_is and _narrows(v.dtype, dtype) and (stored is None or v in stored)
    ]


def wider_than(values: list[Value], dtype: str) -> int:
    """Bytes values hold beyond copies of them in dtype."""
    narrow = np_dtype(dtype).itemsize
    return sum(v.type.nbytes - v.type.nbytes * narrow // np_dtype(v.dtype).itemsize for v in values)


def is_saved_narrowing(node: Value, forward: set[Value]) -> bool:
    """Whether node is a narrowing cast of a forward value that only the gradient part reads:
    the joint plan's saved_dtype copy, computed in its forward part."""
    if node.op != "astype" or node.inputs[0] not in forward:
        return False
    return _narrows(node.inputs[0].dtype, node.dtype)


def _narrows(source: str, target: str) -> bool:
    return is_float(source) and np_dtype(target).itemsize < np_dtype(source).itemsize


def _read_widened(graph: Graph, saved: Value, dtype: str) -> None:
    """The saved input becomes dtype; one astype, just before its first reader, gives its
    readers their old type back."""
    wide = Value("astype", (saved,), {"dtype": saved.dtype}, saved.type, saved.loc)
    readers = [k for k, node in enumerate(graph.nodes) if saved in node.inputs]
    for node in graph.nodes:
        node.inputs = tuple(wide if i is saved else i for i in node.inputs)
    graph.outputs = [wide if o is saved else o for o in graph.outputs]
    saved.type = TensorType(dtype, saved.shape)
    graph.nodes.insert(readers[0] if readers else len(graph.nodes), wide)
