"""A reshape of a strided view (a fused qkv projection's q sliced out, then split into heads;
attention's heads moved back beside the features, then flattened) cannot be a NumPy view: the
compiled driver would copy it with np.ascontiguousarray, an allocation inside the call that no
plan counts. This lowering step makes that copy a node of the plan instead (an astype to the
same dtype, read by the reshape), so the memory planner gives it a buffer (a slice of the
arena, or an output when it is saved), explain's peak counts it and the checked mode
(BACKPLAN_CHECK_MEMORY) sees it; the driver's reshape is then of a contiguous buffer.

Codegen's rule is mirrored (codegen/render/placement.py): every buffer is C-contiguous, a
transpose, slice or broadcast derives its strides from its input's, and a reshape of a
non-contiguous array is placed only when it adds or drops size-1 axes; any other is copied
(a loop, a GEMM or a library kernel reading it reads the copy). 16-bit values are left as
they were; a chain over a `full` literal is never a buffer. One copy per view chain (the same
views of one buffer), however many reshapes read it.
"""

from __future__ import annotations

from .fusion import internal_shape
from .graph import Graph, Value
from .layout import reads_its_input, storage_root
from .reference_storage import c_strides
from .types import is_half


def is_strided_copy(value: Value) -> bool:
    """A copy this step made (reports call it a copy: the user wrote a reshape)."""
    return value.op == "astype" and value.dtype == value.inputs[0].dtype


def copies_needed(graph: Graph) -> list[Value]:
    """The reshapes of `graph` that no strides over their input's buffer express. Only views
    are walked: any other node's buffer is C-contiguous (what `_strides` falls back to for an
    input it was not given), and most plans hold few views among thousands of nodes."""
    strides: dict[Value, tuple | None] = {}
    needed = []
    for node in graph.nodes:
        if node.op not in _VIEWS or is_half(node.dtype):
            continue
        strides[node] = _strides(node, strides)
        if strides[node] is None:
            needed.append(node)
    return needed


def copy_strided_reshapes(
    graph: Graph, origin: dict[Value, Value] | None
) -> tuple[Graph, dict[Value, Value] | None]:
    """(graph with an explicit copy before each reshape of a strided view, each node's node
    of the graph given: origin composed, the copy standing for its reshape). Unchanged (the
    same graph and origin) when no reshape needs one."""
    needed = set(copies_needed(graph))
    if not needed:
        return graph, origin
    new = Graph(graph.name, list(graph.inputs), [], [], dict(graph.constants))
    mapping: dict[Value, Value] = {v: v for v in graph.inputs}
    copies: dict[tuple, Value] = {}  # view chain (new graph) -> its copy
    source: dict[Value, Value] = {}  # node of new -> node of graph it computes
    for node in graph.nodes:
        inputs = [mapping[i] for i in node.inputs]
        if node in needed:
            viewed, chain = inputs[0], _view_chain(inputs[0])
            if chain not in copies:
                copy = Value("astype", [viewed], {"dtype": viewed.dtype}, viewed.type, node.loc)
                copies[chain] = _add(new, copy)
                source[copy] = node
            inputs = [copies[chain]]
        if all(a is b for a, b in zip(inputs, node.inputs, strict=True)):
            mapping[node] = _add(new, node)
        else:
            mapping[node] = _add(new, Value(node.op, inputs, node.attrs, node.type, node.loc))
        source[mapping[node]] = node
    new.outputs = [mapping[o] for o in graph.outputs]
    if origin is None:
        return new, source
    return new, {v: origin[s] for v, s in source.items() if s in origin}


def _strides(node: Value, known: dict) -> tuple | None:
    """node's strides in elements as the driver places it (codegen/render/placement.py: a
    buffer is C-contiguous, a view derives its strides from its input's), None for a reshape
    that merges strided axes: the driver would copy it."""
    shape = internal_shape(node.shape)
    if node.op not in _VIEWS or is_half(node.dtype):
        return c_strides(shape)
    source = node.inputs[0]
    have = known.get(source) or c_strides(internal_shape(source.shape))
    if node.op != "reshape":
        return _VIEWS[node.op](node, have, shape)
    if _is_contiguous(internal_shape(source.shape), have):
        return c_strides(shape)
    sizes = internal_shape(source.shape)
    if [n for n in sizes if n != 1] != [n for n in shape if n != 1]:
        return None if storage_root(source).op != "full" else c_strides(shape)
    kept = iter([s for n, s in zip(sizes, have, strict=True) if n != 1])
    return tuple(next(kept) if n != 1 else 0 for n in shape)


def _is_contiguous(shape: tuple, strides: tuple) -> bool:
    if 0 in shape:
        return True
    expected = 1
    for size, stride in zip(reversed(shape), reversed(strides), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _transpose(node: Value, strides: tuple, shape) -> tuple:
    perm = node.attrs["perm"] if node.shape else (0,)
    return tuple(strides[p] for p in perm)


def _slice(node: Value, strides: tuple, shape) -> tuple:
    return tuple(c * s for c, s in zip(node.attrs["steps"], strides, strict=True))


def _broadcast(node: Value, strides: tuple, shape) -> tuple:
    sizes = internal_shape(node.inputs[0].shape)
    shift = len(shape) - len(sizes)
    return tuple([0] * shift) + tuple(
        0 if n == 1 and shape[k + shift] != 1 else s
        for k, (n, s) in enumerate(zip(sizes, strides, strict=True))
    )


_VIEWS = {"transpose": _transpose, "slice": _slice, "broadcast_to": _broadcast, "reshape": None}


def _view_chain(value: Value) -> tuple:
    """(the value under value's views, the views): equal chains read the same data (the same
    transpose recomputed for the backward is copied once)."""
    views = []
    while reads_its_input(value):
        views.append((value.op, repr(sorted(value.attrs.items())), value.shape))
        value = value.inputs[0]
    return value, tuple(views)


def _add(graph: Graph, value: Value) -> Value:
    graph.nodes.append(value)
    return value
