"""Every array a compiled driver would copy is a node of the plan instead: a reshape of a
strided view (a fused qkv projection's q sliced out, then split into heads), a GEMM operand
that is strided where it lives or broadcast over the batch, an operand of a library kernel
(softmax, cumsum, cross_entropy, ...) that is a strided view or a literal, a logsumexp over
axes that are not adjacent. In the driver each would be np.ascontiguousarray or np.full, an
allocation inside the call that no plan counts; as a node (an astype to the same dtype) the
memory planner gives it a buffer (a slice of the arena, or an output when it is saved),
explain's peak counts it and the checked mode (BACKPLAN_CHECK_MEMORY) sees it. The checked
mode refuses a driver that still allocates (codegen/render/driver_allocations.py).

A 2-D float32 / float64 GEMM reads an operand that is strided where it lives in place
(reads_strided_operand): backplan's GEMM takes any strides; only a literal operand, a 16-bit
one, a batched product's operands, and operands whose copies take no more bytes than the
packing pages reading them in place would add (_copies_cheaper: small ones, whose pages are
mostly padding, and ones the GEMM would pack whole anyway, kept by the process) are copied.

Codegen's rule is mirrored (codegen/render/placement.py): every buffer is C-contiguous, a
transpose, slice or broadcast derives its strides from its input's, and a reshape of a
non-contiguous array is placed only when it adds or drops size-1 axes; any other is copied
(a loop, a GEMM or a library kernel reading it reads the copy). Which operands a kernel reads
as C-contiguous arrays mirrors the emitters (codegen/kernels/*.py): a change there must
change _operand_copies too. 16-bit views and row-kernel operands are left as they were (a
GEMM's 16-bit operands are copied, bits unchanged: codegen/render/scalar.py `_astype`); a
chain over a `full` literal is never a buffer, except as an operand of a kernel call. One
copy per view chain (the same views of one buffer), however many readers read it.
"""

from __future__ import annotations

import functools
import math

from .fusion import internal_shape
from .gemm_packing import in_place_packing_bytes
from .graph import Graph, Value, shared_prefix
from .layout import Roots, reads_its_input, storage_root
from .reference_storage import c_strides
from .registry import get_op
from .types import TensorType, is_half


def is_strided_copy(value: Value) -> bool:
    """A copy this step made (reports call it a copy: the user wrote a reshape)."""
    return value.op == "astype" and value.dtype == value.inputs[0].dtype


def copies_needed(graph: Graph) -> list[Value]:
    """The reshapes of `graph` that no strides over their input's buffer express."""
    return [n for n, how in _needed(graph).items() if how == _RESHAPE]


_RESHAPE, _LOGSUMEXP = "reshape", "logsumexp"


def _needed(graph: Graph, earlier: tuple | None = None, pins=None) -> dict[Value, object]:
    """node -> how it reads a copy: _RESHAPE (its input, copied), _LOGSUMEXP (its input
    transposed so the reduced axes come last, copied), or {operand index: the batch shape a
    GEMM operand is broadcast to first, or None}. Strides are worked out for views only: any
    other node's buffer is C-contiguous (what `_strides` falls back to for an input it was
    not given), and most plans hold few views among thousands of nodes. earlier, pins: see
    copy_strided_reshapes."""
    strides = _Strides()
    needed: dict[Value, object] = {}
    roots = Roots()  # storage roots of the operands asked (_literal), each worked out once
    nodes = graph.nodes
    start = 0
    if earlier is not None:
        start = shared_prefix(earlier[0], nodes)
        if earlier[1]:
            after = set(earlier[0][start:])
            needed.update((n, how) for n, how in earlier[1].items() if n not in after)
        nodes = nodes[start:]
    for position, node in enumerate(nodes, start):
        if node.op in _VIEWS:
            # only a reshape can need a copy; other views' strides are worked out when read
            if node.op == "reshape" and not is_half(node.dtype) and strides[node] is None:
                needed[node] = _RESHAPE
        elif node.op == "logsumexp" and _scattered_axes(node) and not is_half(node.dtype):
            needed[node] = _LOGSUMEXP
        elif _own_kernel(node.op):
            pin = None if pins is None else (pins, position)
            operands = _operand_copies(node, strides, roots, pin)
            if operands:
                needed[node] = operands
    return needed


@functools.cache
def _own_kernel(op: str) -> bool:
    """An op compiled as a call of its own (codegen/render/opaque.py's emitters), not a
    fused loop, view, alias or literal (ir/fusion.py's grouping). Asked once per op name: a
    lowering walks every node."""
    if op in ("input", "full", "const"):
        return False
    spec = get_op(op)
    return spec.scalar is None and not spec.loop_tail and spec.fusion != "view" and not spec.alias


def _operand_copies(node: Value, strides: dict, roots=None, pin=None) -> dict[int, tuple | None]:
    """The operands of an op compiled as a call of its own that its emitter would copy in the
    driver: a literal (np.full there) or a strided view where it reads a C-contiguous array.
    A GEMM's have rules of their own; concatenate and pad_slice, and attention in its
    token-first layout or with two leading axes, read strided views as they are (attention
    not a literal: the gradient of a sum of its output, which the emitter would np.full)."""
    if node.op == "matmul":
        return _matmul_copies(node, strides, roots, pin)
    attention = node.op in ("attention", "attention_grad")
    strided_ok = node.op in ("concatenate", "pad_slice") or (
        attention and (node.attrs.get("layout", "bhtd") == "bthd" or len(node.inputs[0].shape) == 4)
    )
    found: dict[int, tuple | None] = {}
    for i, value in enumerate(node.inputs):
        if is_half(value.dtype):
            continue
        if _literal(value, roots) and (attention or not strided_ok):  # np.full, else
            found[i] = None
        elif not strided_ok and not _contiguous_where_it_lives(value, strides):
            found[i] = None
    return found


def copy_strided_reshapes(
    graph: Graph,
    origin: dict[Value, Value] | None,
    sources: dict | None = None,
    earlier: tuple | None = None,
    found: list | None = None,
    pins: dict | None = None,
) -> tuple[Graph, dict[Value, Value] | None]:
    """(graph with an explicit copy wherever compiled code would read one: before each
    reshape of a strided view, each GEMM operand that is strided where it lives or broadcast
    over the batch, a logsumexp over axes that are not consecutive; each node's node of the
    graph given: origin composed, a copy standing for its reader). Unchanged (the same graph
    and origin) when nothing needs one. sources, if given, gets each new node -> the node
    of graph it computes (a copy: its reader). earlier: (nodes, what `_needed` found for
    them) of a graph whose first nodes may be this one's (a memory plan's row before,
    ir/grouping_resume.py): a node's copies follow from the nodes it reads alone, so only
    the nodes after the shared ones are asked. found, if given, gets (graph.nodes, needed).
    pins: a symbolic plan's sizes' dict of whether each 2-D product (by position) copies its
    strided operands (_copies_cheaper), decided once for all of them."""
    needed = _needed(graph, earlier, pins)
    if found is not None:
        found.append((graph.nodes, needed))
    if not needed:
        return graph, origin
    rewrite = _Rewrite(graph)
    for node in graph.nodes:
        rewrite.node(node, needed.get(node))
    new, source = rewrite.new, rewrite.source
    if sources is not None:
        sources.update((v, s) for v, s in source.items() if v is not s)
    new.outputs = [rewrite.mapping[o] for o in graph.outputs]
    if origin is None:
        return new, source
    return new, {v: origin[s] for v, s in source.items() if s in origin}


class _Rewrite:
    """The new graph as it is built: each node of the old one, its inputs mapped, reading a
    copy where `_needed` says so."""

    def __init__(self, graph: Graph):
        self.new = Graph(graph.name, list(graph.inputs), [], [], dict(graph.constants))
        self.mapping: dict[Value, Value] = {v: v for v in graph.inputs}
        self.copies: dict[tuple, Value] = {}  # view chain (new graph) -> its copy
        self.source: dict[Value, Value] = {}  # node of new -> node of graph it computes

    def node(self, node: Value, how) -> None:
        inputs = [self.mapping[i] for i in node.inputs]
        if how == _LOGSUMEXP:
            self.mapping[node] = _logsumexp_of_copy(node, inputs[0], self)
            return
        if how == _RESHAPE:
            inputs = [self.copy_of(inputs[0], node)]
        elif how is not None:
            for i, batch in how.items():
                if node.op == "matmul":
                    inputs[i] = _gemm_operand(inputs[i], batch, node, self)
                else:
                    inputs[i] = self.copy_of(inputs[i], node)
        if all(a is b for a, b in zip(inputs, node.inputs, strict=True)):
            made = self.mapping[node] = _add(self.new, node)
        else:
            made = Value(node.op, inputs, node.attrs, node.type, node.loc)
            self.mapping[node] = _add(self.new, made)
        self.source[made] = node

    def copy_of(self, viewed: Value, reader: Value) -> Value:
        """A copy of `viewed` (one per view chain), standing for `reader` in reports."""
        chain = _view_chain(viewed)
        if chain not in self.copies:
            copy = Value("astype", [viewed], {"dtype": viewed.dtype}, viewed.type, reader.loc)
            self.copies[chain] = self.made(copy, reader)
        return self.copies[chain]

    def view(self, op: str, value: Value, attrs: dict, shape, reader: Value) -> Value:
        type_ = TensorType(value.dtype, tuple(shape))
        return self.made(Value(op, [value], attrs, type_, reader.loc), reader)

    def made(self, value: Value, reader: Value) -> Value:
        self.source[value] = reader
        return _add(self.new, value)


def _matmul_copies(node: Value, strides: dict, roots=None, pin=None) -> dict[int, tuple | None]:
    """The operands codegen's GEMM (codegen/kernels/matmul.py) reads only after a copy: one
    that is not C-contiguous where it lives once a transpose of its last two axes is taken as
    a flag, or (batched) whose batch is broadcast to the product's other than by a leading 1.
    index -> the batch shape to broadcast it to first (None: copied as it is)."""
    batch = tuple(node.shape[:-2])
    found: dict[int, tuple | None] = {}
    strided: list[int] = []  # a 2-D product's operands strided where they live
    for i, value in enumerate(node.inputs):
        source = value.inputs[0] if _absorbed(value) else value
        if _literal(source, roots):
            found[i] = None
            continue
        if not batch:  # a 2-D product (most of a deep plan's): only its layout matters
            if not _contiguous_where_it_lives(source, strides):
                strided.append(i)
            continue
        padded = (1,) * (len(batch) - len(source.shape[:-2])) + tuple(source.shape[:-2])
        count = math.prod(padded)
        if batch and (count not in (1, math.prod(batch)) or (count != 1 and padded != batch)):
            found[i] = batch
        elif not _contiguous_where_it_lives(source, strides):
            found[i] = None
    if strided and (not _strided_gemm_dtypes(node) or _copies_cheaper(node, strided, strides, pin)):
        found.update((i, None) for i in strided)
    return found


def _copies_cheaper(node: Value, indices: list, strides: dict, pin=None) -> bool:
    """Whether a 2-D product's strided operands (`indices`) are copied rather than read where
    they live: when the copies take no more bytes than the packing pages its GEMM would write
    reading them there beyond those it writes on the copies (ir/gemm_packing.py; a 5 x 8
    operand: 160 B copied against 12 KiB of pages, kept by the process). pin: (a symbolic
    plan's dict, the node's position): its sizes decide as the first one did, so that they
    keep one graph and one driver."""
    if pin is not None and pin[1] in pin[0]:
        return pin[0][pin[1]]
    copied = sum(math.prod(node.inputs[i].shape) for i in indices) * (
        8 if node.dtype == "f64" else 4
    )
    cheaper = copied <= in_place_packing_bytes(node, operand_strides(node, strides))
    if pin is not None:
        pin[0][pin[1]] = cheaper
    return cheaper


def reads_strided_operand(node: Value) -> bool:
    """Whether a 2-D float32 or float64 matmul reads an operand strided where it lives (a
    sliced, reversed or broadcast view: w[:, ::2], w[::-1], a column block), which backplan's
    GEMM then reads in place (codegen/kernels/matmul.py own_gemm_strided_at: it takes any
    strides, negative and zero included) instead of a copy in the arena: codegen runs such a
    product on it, never on BLAS (codegen/render/opaque.py own_gemm_chosen)."""
    if node.op != "matmul" or len(node.shape) != 2 or not _strided_gemm_dtypes(node):
        return False
    strides = _Strides()
    for value in node.inputs:
        source = value.inputs[0] if _absorbed(value) else value
        if not _literal(source) and not _contiguous_where_it_lives(source, strides):
            return True
    return False


def operand_strides(node: Value, strides: dict | None = None) -> list[tuple[bool, tuple]]:
    """(transposed?, element strides of the matrix it reads) of each operand of a 2-D
    matmul, as codegen's strided GEMM entry is given them (codegen/kernels/matmul.py
    _strided_matmul: the array under a transpose of its last two axes, taken as a flag).
    strides: a `_Strides` to share (copy_strided_reshapes's)."""
    strides = _Strides() if strides is None else strides
    found = []
    for value in node.inputs:
        flag = _absorbed(value)
        source = value.inputs[0] if flag else value
        known = strides[source] if source.op in _VIEWS else None
        found.append((flag, tuple(known or c_strides(internal_shape(source.shape)))))
    return found


def _strided_gemm_dtypes(node: Value) -> bool:
    """A product the strided GEMM entry takes: float32 or float64 operands and result, one
    dtype (16-bit operands are copied, as the GEMM's widening pack reads them)."""
    return node.dtype in ("f32", "f64") and all(v.dtype == node.dtype for v in node.inputs)


def _gemm_operand(operand: Value, batch, reader: Value, rewrite: _Rewrite) -> Value:
    """A GEMM operand read from a copy: the array under a transpose of its last two axes
    (kept as the GEMM's flag, over the copy), broadcast over the batch first when `batch`."""
    flag = _absorbed(operand)
    base = operand.inputs[0] if flag else operand
    if batch is not None:
        shape = tuple(batch) + tuple(base.shape[-2:])
        base = rewrite.view("broadcast_to", base, {"shape": shape}, shape, reader)
    copied = rewrite.copy_of(base, reader)
    if not flag:
        return copied
    n, shape = len(base.shape), tuple(base.shape)
    perm = tuple(range(n - 2)) + (n - 1, n - 2)
    flipped = shape[:-2] + (shape[-1], shape[-2])
    return rewrite.view("transpose", copied, {"perm": perm}, flipped, reader)


def _contiguous_where_it_lives(value: Value, strides: dict) -> bool:
    """Only views have strides of their own (`_Strides` works them out); any other value is a
    C-contiguous buffer, asked of thousands of GEMM operands without building its strides."""
    known = strides[value] if value.op in _VIEWS else None
    return not known or _is_contiguous(internal_shape(value.shape), known)


class _Strides(dict):
    """view -> its strides in elements as the driver places it (None: a reshape the driver
    would copy, whose readers read the copy: C-contiguous), worked out when first read, from
    its input's; any other value (and a 16-bit view) -> None: a C-contiguous buffer. A deep
    plan's thousands of transposes are GEMM flags whose strides nothing reads (a
    10,000-node row worked out ~2,200 it never used)."""

    __slots__ = ()

    def __missing__(self, value: Value):
        chain = []  # the views under value not yet worked out, walked without recursion
        while value.op in _VIEWS and not is_half(value.dtype) and value not in self:
            chain.append(value)
            value = value.inputs[0]
        for view in reversed(chain):
            self[view] = _strides(view, self)
        return self[chain[0]] if chain else None


def _absorbed(value: Value) -> bool:
    """A transpose of the last two axes, which a GEMM takes as a flag (OpEmitter.absorbs)."""
    if value.op != "transpose":
        return False
    n = len(value.type.shape)
    return n >= 2 and value.attrs["perm"] == (tuple(range(n - 2)) + (n - 1, n - 2))


def _scattered_axes(node: Value) -> bool:
    """A logsumexp over axes that are not consecutive: its kernel reads the reduced axes as
    one run (codegen/kernels/rows.py), so they are moved last and copied first."""
    axes = list(node.attrs["axes"])
    return bool(axes) and axes != list(range(axes[0], axes[-1] + 1))


def _logsumexp_of_copy(node: Value, x: Value, rewrite: _Rewrite) -> Value:
    """logsumexp(x, scattered axes) as a reshape of the logsumexp over the trailing axes of a
    copy of x with those axes moved last: the same values, in the same order."""
    axes = list(node.attrs["axes"])
    kept = [a for a in range(len(x.shape)) if a not in axes]
    perm = tuple(kept + axes)
    moved = rewrite.view("transpose", x, {"perm": perm}, [x.shape[a] for a in perm], node)
    copy = rewrite.copy_of(moved, node)
    attrs = {**node.attrs, "axes": tuple(range(len(kept), len(perm))), "keepdims": False}
    reduced = TensorType(node.dtype, tuple(x.shape[a] for a in kept))
    summed = rewrite.made(Value("logsumexp", [copy], attrs, reduced, node.loc), node)
    return rewrite.view("reshape", summed, {"shape": tuple(node.shape)}, node.shape, node)


def _literal(value: Value, roots: Roots | None = None) -> bool:
    """A chain over a `full` literal: codegen makes it from the number, never a buffer."""
    return (storage_root(value) if roots is None else roots[value]).op == "full"


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
