"""NumPy arrays as arguments of a compiled call, read in place.

On the fast path a NumPy argument reaches the plan as a read-only view of the caller's buffer:
no copy, and the plan's kernels cannot write into it (they see the same read-only array type
as a tensor's, so no second specialisation is compiled). A copy, in C order at memory speed, is
made only where the array would outlive the call:

- an output is the argument itself or a view of it (the caller would see the result change);
- a forward input saved for a later `.backward()` (`bp.compile`; backward reads it later);
- a donated argument (the call writes its results into the buffer it is given);
- on the reference interpreter, an output NumPy makes a view of the argument (a transpose, a
  slice: ir/reference_storage.py), and an argument not in C order that a reshape reads
  (copied in C order, which the interpreter's storage model assumes of its inputs).

The first call of a signature does the same (tracer/signature.py bind_call wraps each native
NumPy array as a read-only view): what explain prints for a call is what it holds, first call
included, on both backends.

explain counts each of these copies where it is made (report/argument_copies.py: saved ones as
saved, call_copies' as outputs or for the call's duration), and so does the checked mode
(runtime/execute.py count_argument_copy).

So changing the array after a call never changes what the call returned, nor the gradients a
later backward computes. Changing it from another thread *during* the call is a data race, as
it is for any NumPy function given that array.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter

import numpy as np

from backplan.ir.argument_layout import same_layout
from backplan.ir.graph import Graph
from backplan.ir.layout import storage_root
from backplan.ir.reference_storage import storage_roots
from backplan.runtime.backend import current_backend
from backplan.runtime.execute import count_argument_copy

from .tensor import Tensor, read_only


def kept_by_outputs(graph: Graph, reference: bool = False) -> set[int]:
    """Graph inputs whose buffer an output reads: the input itself or a view of it, in the
    compiled plan's buffers or (reference) in NumPy's, where a transpose or a slice is a view."""
    index = {v: i for i, v in enumerate(graph.inputs)}
    if reference:
        found = storage_roots(graph)
        roots = (found.get(out, out) for out in graph.outputs)
    else:
        roots = (storage_root(out) for out in graph.outputs)
    return {index[root] for root in roots if root in index}


def borrowed(array: np.ndarray) -> np.ndarray:
    """A read-only view of the caller's array: the plan reads it, nobody writes through it."""
    view = array.view()
    read_only(view)
    return view


def copied(array: np.ndarray, order: str = "C") -> np.ndarray:
    """A private copy, read-only like every tensor's buffer: C-ordered, or with order="K" in
    the array's own layout (an F-order, broadcast or reversed array stays one, which a plan
    reads in place: ir/in_place_inputs.py; a broadcast one copied at its compact size)."""
    copy = same_layout(array) if order == "K" else np.array(array, order="C")
    read_only(copy)
    return count_argument_copy(copy)


def input_array(leaf, copy) -> np.ndarray:
    """A fast-path leaf (tensor, Python float or NumPy array) as the array the plan reads;
    copy: this input would outlive the call (see the module docstring), True for a C-ordered
    copy (a donated buffer, which outputs of C order are written into; the reference
    interpreter's), "K" for one in the array's own order (saved for backward, read by an
    output), False for none (a read-only view of the caller's array)."""
    kind = type(leaf)
    if kind is Tensor:
        return leaf._data
    if kind is float:
        return np.array(leaf, np.float64)
    if copy == "K":
        return copied(leaf, "K")
    return copied(leaf) if copy else borrowed(leaf)


def arrays_reader(
    kinds: list[type], copies: list[bool], interpreted: list[bool]
) -> Callable[[list, bool], list]:
    """For one signature: read(leaves, reference) gives the arrays the plan reads from the
    fast path's leaves, whose kinds (Tensor, float, np.ndarray) the signature fixes; copies:
    which inputs outlive the call when the compiled plan runs, interpreted: when the reference
    interpreter runs it (reference_copies)."""
    if all(kind is Tensor for kind in kinds):
        data = attrgetter("_data")
        return lambda leaves, reference: list(map(data, leaves))
    compiled = [_reader(kind, copy) for kind, copy in zip(kinds, copies, strict=True)]
    by_reference = [_reader(kind, copy) for kind, copy in zip(kinds, interpreted, strict=True)]

    def read(leaves: list, reference: bool) -> list:
        readers = by_reference if reference else compiled
        return [reader(leaf) for reader, leaf in zip(readers, leaves, strict=True)]

    return read


def reference_copies(graph: Graph, kept: set[int], leaves: list) -> list:
    """The copy the reference interpreter gets of each of the fast path's leaves (input_array's
    `copy`): True (C order) for a NumPy array not in C order that a reshape reads
    (reshaped_inputs: the interpreter's storage model, which says whether NumPy's reshape is
    a view, reads every input as C-contiguous), "K" for any other kept one
    (kept_by_outputs(graph, reference=True), saved, donated), False for the rest: read where
    they are, in their own layout, as a tensor's array is."""
    arrays = [type(leaf) is np.ndarray for leaf in leaves]
    reshaped = reshaped_inputs(graph) if any(arrays) else ()
    return [
        True
        if array and k in reshaped and not leaf.flags.c_contiguous
        else ("K" if k in kept else False)
        for k, (leaf, array) in enumerate(zip(leaves, arrays, strict=True))
    ]


def call_copies(
    graph: Graph, leaves: list, donated=(), reference: bool = False
) -> tuple[frozenset[int], frozenset[int]]:
    """(kept, during): the graph inputs passed as NumPy arrays in `leaves` (the plan's order)
    that the call copies because an output reads them (kept_by_outputs: the copy is that
    output), and those it copies for the call alone: an array in another byte order (its
    values converted), and on the reference interpreter one not in C order that a reshape
    reads (reference_copies). A donated one is copied in C order: outputs are written into the
    copy where the plan is compiled (kept), the interpreter reads it for the call (during)."""
    arrays = {k for k, leaf in enumerate(leaves) if isinstance(leaf, np.ndarray)}
    if not arrays:
        return frozenset(), frozenset()
    given = arrays & set(donated)
    kept = kept_by_outputs(graph, reference) & arrays | (set() if reference else given)
    during = {k for k in arrays if not leaves[k].dtype.isnative} | (given if reference else set())
    if reference:
        reshaped = reshaped_inputs(graph) & arrays
        during |= {k for k in reshaped if not leaves[k].flags.c_contiguous}
    return frozenset(kept), frozenset(during)


def joint_copies(entry, call) -> tuple[frozenset[int], frozenset[int]]:
    """call_copies for a joint plan's call (entry: tracer/functional.py JointTrace) on the
    backend running now: the copies explain counts (a joint plan saves nothing past it)."""
    if not getattr(call, "sources", None):
        return frozenset(), frozenset()
    sources = [call.sources[p] for p in call.tensor_positions]
    return call_copies(entry.plan.graph, sources, (), current_backend() == "reference")


def reshaped_inputs(graph: Graph) -> set[int]:
    """Graph inputs a reshape reads, directly or through views living in their buffer."""
    roots = storage_roots(graph)
    index = {v: i for i, v in enumerate(graph.inputs)}
    return {
        index[roots[node.inputs[0]]]
        for node in graph.nodes
        if node.op == "reshape" and roots.get(node.inputs[0]) in index
    }


def _reader(kind: type, copy) -> Callable:
    if kind is Tensor:
        return attrgetter("_data")
    if kind is float:
        return lambda leaf: np.array(leaf, np.float64)
    if copy == "K":
        return lambda leaf: copied(leaf, "K")
    return copied if copy else borrowed


def input_tensor(leaf, copy) -> Tensor:
    """A fast-path leaf as the tensor the plan takes: Python floats become weak 0-d tensors,
    NumPy arrays borrowed or copied tensors."""
    kind = type(leaf)
    if kind is Tensor:
        return leaf
    if kind is float:
        return Tensor._weak_scalar(leaf)
    return Tensor._fresh(input_array(leaf, copy))
