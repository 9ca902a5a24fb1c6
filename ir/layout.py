"""Where every buffer of a lowered plan lives, decided before anything runs: the memory-plan
step of the pipeline (codegen turns each placement into an array expression).

- Outputs (a region's user outputs and saved buffers, gradients) are fresh arrays per call,
  allocated by the caller, so they can outlive the call and scratch never escapes.
- Every other buffer is a slice of a scratch arena per dtype, kept by the compiled plan and
  reused on every call; buffers with disjoint lifetimes share bytes (ir/memory_plan.py), and an
  elementwise output may take over a dying input in place.
- In the consuming variant of a backward plan, a temporary may also live in a private saved
  buffer after that buffer's last read (retain_graph=False has already given it up).
Views and aliases have no storage: reading them extends the life of what they view.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from operator import le

from .fusion import Kernel, index_map, internal_shape, is_alias
from .graph import Graph, Value
from .kernel_workspace import WORKSPACE_OPS, WorkspaceOf, workspace_elements
from .memory_plan import BufferRequest, MemoryPlanError, element_offsets, swept_arena_sizes
from .registry import REGISTRY, get_op
from .types import DTYPES

# Elementwise outputs may overwrite a dying input in place. Off: LLVM cannot prove the two
# array views are the same element for element, so its runtime overlap check fails and the
# loop runs scalar (measured: an MLP step's loops 384 us in place, 20 us apart).
IN_PLACE = False
# A GEMM's epilogue may write its result over the GEMM's product (_epilogues_over_products).
EPILOGUE_OVER_PRODUCT = True


_PLACED_LATER = ("scratch_offsets", "workspaces")


def reads_its_input(value: Value) -> bool:
    """A view or alias: no buffer of its own, it reads its (only) input's."""
    known = _READS_ITS_INPUT.get(value.op)
    if known is not None:
        return known
    op = value.op
    if op == "input":
        known = False
    else:
        spec = REGISTRY.get(op) or get_op(op)
        if spec.fusion != "view" and op == "reshape":
            return is_alias(value)  # a unit reshape is an alias: the node decides
        known = spec.fusion == "view" or is_alias(value)
    _READS_ITS_INPUT[op] = known
    return known


# op -> whether every value of it reads its input's buffer: asked of every value of every plan
# lowered (Roots), and but for a reshape that is no view the op alone decides it
_READS_ITS_INPUT: dict[str, bool] = {}


def storage_root(value: Value) -> Value:
    """The value whose buffer `value` reads: views and aliases lead back to it."""
    while reads_its_input(value):
        value = value.inputs[0]
    return value


class Roots(dict):
    """value -> storage_root(value), each worked out once (from its input's, where it reads
    that): a lowering asks it of every input of every kernel in several passes. Values never
    change op or inputs while a plan is lowered."""

    __slots__ = ()

    def __missing__(self, value: Value) -> Value:
        known = _READS_ITS_INPUT.get(value.op)  # reads_its_input's answer by op, asked inline
        if known is None:  # (~14,000 values a row of a 10,000-node memory frontier)
            known = reads_its_input(value)
        root = self[value] = self[value.inputs[0]] if known else value
        return root


@dataclass
class BufferLayout:
    outputs: list[Value] = field(default_factory=list)  # roots the caller allocates per call
    scratch_elements: dict = field(default_factory=dict)  # dtype -> arena length as that dtype
    reused_saved: dict = field(default_factory=dict)  # value -> saved input it lives in
    scratch_offsets: dict = field(default_factory=dict)  # value -> element offset in its arena
    # value -> rows its buffer holds, for values a row kernel keeps one row at a time
    # (ir/row_local.py): a slice of that many rows, not the value's whole shape
    row_local: dict = field(default_factory=dict)
    # kernel node -> (element offset in its dtype's arena, elements) of the workspace the
    # kernel is passed (ir/kernel_workspace.py), held at the kernel's step only
    workspaces: dict = field(default_factory=dict)

    def __getattr__(self, name: str):
        """scratch_offsets and workspaces of a layout whose arena was sized from its requests
        alone (plan_layout): placed when first read (_placed)."""
        if name in _PLACED_LATER:
            return _placed(self, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def reserved_bytes(self, value: Value) -> int:
        """The bytes a buffer of the plan holds for value (one item for an empty one)."""
        rows = self.row_local.get(value)
        nbytes = value.type.nbytes
        if rows is not None:
            nbytes = nbytes // internal_shape(value.shape)[0] * rows
        return max(nbytes, DTYPES[value.dtype].itemsize)

    @property
    def scratch_bytes(self) -> int:
        """The one scratch arena's bytes: every dtype views the same buffer (at least one item
        of each, as the runtime allocates it)."""
        return max(
            (max(n, 1) * DTYPES[d].itemsize for d, n in self.scratch_elements.items()), default=0
        )

    @property
    def output_bytes(self) -> int:
        return sum(v.type.nbytes for v in self.outputs)

    def describe(self, names: dict) -> dict:
        """The plan as plain data (value names from the IR text): for reports and exports."""
        where = {
            names[v]: ["scratch", v.dtype, offset, self.reserved_bytes(v)]
            for v, offset in self.scratch_offsets.items()
        }
        where.update({names[v]: ["output", v.dtype, 0, v.type.nbytes] for v in self.outputs})
        where.update(
            {
                names[v]: ["in saved " + names[s], v.dtype, 0, self.reserved_bytes(v)]
                for v, s in self.reused_saved.items()
            }
        )
        workspaces = {  # the arena bytes a kernel works in at its step (ir/kernel_workspace.py)
            names[v]: [v.dtype, offset, count * DTYPES[v.dtype].itemsize]
            for v, (offset, count) in self.workspaces.items()
        }
        return {
            "scratch_elements": dict(sorted(self.scratch_elements.items())),
            "buffers": dict(sorted(where.items(), key=lambda kv: int(kv[0][1:]))),
            "workspaces": dict(sorted(workspaces.items(), key=lambda kv: int(kv[0][1:]))),
        }


def lifetimes(
    graph: Graph,
    kernels: list[Kernel],
    steps: list[int],
    roots: Roots | None = None,
    read: dict | None = None,
) -> dict[Value, int]:
    """Last step that reads each storage root (through views); outputs live past the end.
    roots: storage roots already worked out for this graph (the lowering shares one). read:
    each value the kernels' computed nodes read -> the step of its latest read, where the
    caller walked them already (ir/lowering.py _buffers; steps in run order): taken over
    and changed, not copied."""
    roots = Roots() if roots is None else roots
    if len(steps) != len(kernels):
        raise ValueError(f"{len(steps)} steps for {len(kernels)} kernels")
    if all(map(le, steps, steps[1:])):  # steps in run order (schedule_steps): the last is latest
        # each value read, then each view's or alias's latest read moved to its root: only
        # kernels that run no code hold those (_views_read_last), and a lowering's storage
        # roots asked of every input were a third of this walk (~23,000 a row of a
        # 10,000-node memory frontier, most of them values that are their own root)
        last = read
        if last is None:
            last = {
                inp: step
                for step, kernel in zip(steps, kernels, strict=True)
                for node in kernel.computed
                for inp in node.inputs
            }
        _views_read_last(kernels, roots, last)
    else:
        last: dict[Value, int] = {}
        for step, kernel in zip(steps, kernels, strict=True):
            for node in kernel.computed:
                for inp in node.inputs:
                    root = roots[inp]
                    if last.get(root, -1) < step:
                        last[root] = step
    for out in graph.outputs:
        last[roots[out]] = len(kernels)
    return last


def _views_read_last(kernels: list[Kernel], roots: Roots, last: dict) -> None:
    """last (value -> its latest read) by storage root: a view's or alias's read counts for
    the value it reads, and the view's own entry goes. Views, aliases and aliased literals
    are each the one node of a kernel that runs no code (ir/fusion.py _place), so only those
    kernels' nodes are asked their roots."""
    pop = last.pop
    for kernel in kernels:
        if kernel.kind not in RUNS_CODE:
            value = kernel.nodes[0]
            root = roots[value]
            if root is not value:
                step = pop(value, None)
                if step is not None and last.get(root, -1) < step:
                    last[root] = step


RUNS_CODE = ("loop", "op")  # kernel kinds with code of their own (ir/lowering.py RUN_KINDS)


def plan_layout(
    graph: Graph,
    kernels: list[Kernel],
    buffers: list[Value],
    private_saved: list[Value] = (),
    steps: list[int] | None = None,
    row_local: dict | None = None,
    roots: Roots | None = None,
    written: list[int] | None = None,
    read: dict | None = None,
    pinned: dict | None = None,
    ops: tuple | None = None,
) -> BufferLayout:
    """buffers: values that need storage, in kernel order. private_saved: saved inputs whose
    storage may be reused after their last read (the consuming backward variant only).
    steps: the schedule step of each kernel; kernels fused into one row kernel share a step,
    since their rows interleave (default: one step per kernel). row_local: value -> the rows
    its buffer holds (ir/row_local.py). roots: storage roots already worked out for this
    graph. written: the step each buffer is written at, where the caller listed the buffers
    kernel by kernel (the lowering does): else a map of every node's step is made for them
    (~11,000 nodes a row of a 10,000-node memory frontier, for ~5,500 buffers). read: each
    value read -> its latest step, where the caller walked the kernels (lifetimes). pinned: a
    symbolic plan's attention slot ceilings, shared by its sizes (ir/kernel_workspace.py).
    ops: the (op, dtype) of every op kernel, where the caller noted them (LoweredPlan.op_kinds):
    a plan with no op that works in a workspace is not walked for workspaces."""
    steps = steps if steps is not None else list(range(len(kernels)))
    roots = Roots() if roots is None else roots
    kernel_of, step_of = {}, {}  # every node's kernel and step: in-place candidates ask them
    if written is None or IN_PLACE:
        pairs = zip(kernels, steps, strict=True)
        step_of = {n: step for kernel, step in pairs for n in kernel.all_nodes}
        written = list(map(step_of.__getitem__, buffers))
    if IN_PLACE:
        kernel_of = {n: kernel for kernel in kernels for n in kernel.all_nodes}
    last = lifetimes(graph, kernels, steps, roots, read)
    output_roots = {roots[o] for o in graph.outputs}
    layout = BufferLayout(row_local=dict(row_local or {}))
    requests = []
    add, read_last, rows = requests.append, last.get, layout.row_local
    for value, first in zip(buffers, written, strict=True):
        if value in output_roots:
            layout.outputs.append(value)
            continue
        latest = read_last(value, first)
        nbytes = value.type.nbytes
        if not nbytes or value in rows:
            nbytes = layout.reserved_bytes(value)  # empty: one item; row-local: its rows
        # every field given, without the named tuple's generated __new__: a lowering makes
        # one a buffer (~5,500 a row of a 10,000-node memory frontier)
        request = _request(
            BufferRequest,
            (
                value,
                nbytes,
                value.dtype,
                first,
                latest if latest > first else first,
                "scratch",
                (),
                False,
            ),
        )
        if IN_PLACE:
            candidates = _in_place_candidates(value, kernel_of[value], last, step_of)
            request = request._replace(reuse=candidates)
        add(request)
    if EPILOGUE_OVER_PRODUCT:
        requests = _epilogues_over_products(requests, kernels, last, steps)
    requests = _reuse_saved(requests, private_saved, last, layout)
    workspaces = []
    if ops is None or any(op in WORKSPACE_OPS for op, _ in ops):
        workspaces = _workspace_requests(kernels, steps, pinned)
    everything = requests + [r for r, _ in workspaces]
    sizes = swept_arena_sizes(everything)
    if sizes is None:
        offsets, sizes, _ = element_offsets(everything, shared=True)
        _place(layout, requests, workspaces, offsets)
    else:  # the offsets when something reads them (_placed)
        del layout.scratch_offsets, layout.workspaces
        layout._pending = (requests, workspaces, everything, sizes)
    for (_arena, dtype), size in sizes.items():
        layout.scratch_elements[dtype] = size
    return layout


def _place(layout: BufferLayout, requests: list, workspaces: list, offsets: dict) -> None:
    layout.scratch_offsets = {r.key: offsets[r.key] for r in requests}
    layout.workspaces = {r.key.node: (offsets[r.key], n) for r, n in workspaces}


def _placed(layout: BufferLayout, name: str):
    """A layout's offsets, placed on first read where plan_layout took its arena's size from
    the requests alone (swept_arena_sizes): a memory frontier reads each row's size and never
    its offsets. The placement must end where that size says, or the peak printed for the
    plan would not be the arena it runs with: a mismatch raises, naming both."""
    with _placing:
        pending = layout.__dict__.get("_pending")
        if name not in layout.__dict__ and pending is not None:
            requests, workspaces, everything, sizes = pending
            offsets, placed, _ = element_offsets(everything, shared=True)
            if list(placed.items()) != list(sizes.items()):
                raise MemoryPlanError(
                    f"the arena of {len(everything):,} buffers was sized {sizes} from their "
                    f"lifetimes, but placing them needs {placed}"
                )
            _place(layout, requests, workspaces, offsets)
            del layout._pending
    found = layout.__dict__.get(name, _MISSING)
    if found is _MISSING:
        raise AttributeError(f"{type(layout).__name__!r} object has no attribute {name!r}")
    return found


_MISSING = object()
_placing = threading.Lock()  # two threads reading a pending layout place it once


_request = tuple.__new__  # BufferRequest(*fields), as memory_plan's _placement makes Placements


def _workspace_requests(kernels: list[Kernel], steps: list[int], pinned=None) -> list[tuple]:
    """(a buffer of the arena, the elements the kernel reads of it) for each kernel that works
    in one (ir/kernel_workspace.py), live at its step alone: it shares bytes with buffers whose
    lives end before or start after it. At least one item, as an empty buffer: a size of a
    symbolic plan with an empty batch keeps the structure of the others."""
    found = []
    for index, (kernel, step) in enumerate(zip(kernels, steps, strict=True)):
        if kernel.kind != "op":
            continue
        elements = workspace_elements(kernel, pinned, (len(kernels), index))
        if elements is not None:
            node = kernel.nodes[0]
            nbytes = max(elements, 1) * DTYPES[node.dtype].itemsize
            request = BufferRequest(WorkspaceOf(node), nbytes, node.dtype, step, step)
            found.append((request, elements))
    return found


def _epilogues_over_products(requests, kernels, last, steps) -> list:
    """A GEMM's epilogue writes one of its results over the GEMM's product, where only the
    epilogue reads the product (element for element, ir/epilogue.py) and the two have one
    dtype and size: the epilogue reads each element of a row before it writes that element,
    so the product's buffer is not held beside the result's (a float32 step keeping bfloat16
    saved copies held both across each layer: its forward's arena 1.5 -> 1.0 MiB, 3 x
    tanh(x @ w), 512 x 256)."""
    by_key = {r.key: k for k, r in enumerate(requests)}
    kernels_at = None  # kernels with nodes at each step, counted where a step has several
    shares_step = _step_sharing(steps)  # whether a kernel's step is another's too
    for index, kernel in enumerate(kernels):
        if kernel.epilogue is None or _adds_only(kernel.epilogue):
            continue
        product = kernel.nodes[0]
        at = by_key.get(product)
        if at is None:
            continue  # no buffer of the arena (an output)
        step = requests[at].first_step  # the kernel's (its nodes are written at its step)
        if last.get(product, -1) != step:
            continue  # read later
        if shares_step(index):
            if kernels_at is None:
                kernels_at = Counter(s for k, s in zip(kernels, steps, strict=True) if k.nodes)
            if kernels_at[step] != 1:
                continue  # a step shared with other kernels (a row kernel's)
        old = requests[at]
        for value in kernel.epilogue.nodes:
            k = by_key.get(value)
            if k is None:
                continue
            new = requests[k]
            if (new.dtype, new.nbytes, new.first_step) == (old.dtype, old.nbytes, old.first_step):
                if _read_after(kernel.epilogue, value, product):
                    continue
                requests[k] = BufferRequest(  # new._replace(reuse=..., in_step=True), directly
                    new.key,
                    new.nbytes,
                    new.dtype,
                    new.first_step,
                    new.last_step,
                    new.arena,
                    (product, *new.reuse),
                    True,
                )
                break
    return requests


def _read_after(loop: Kernel, value: Value, product: Value) -> bool:
    """Whether the loop reads the product after it computes value. Each element's nodes are
    computed and stored in order, so value written over the product would be read back in
    its place (a loss's sum of the product fused with the gradient's seed, a `full` computed
    first and stored)."""
    seen = False
    for node in loop.computed:
        if seen and any(v is product or storage_root(v) is product for v in node.inputs):
            return True
        seen = seen or node is value
    return not seen


def _step_sharing(steps: list[int]):
    """index -> whether another kernel has the step of kernel `index`. Steps in run order
    (schedule_steps: a row kernel's stages share its first's) put equal steps side by side,
    so the neighbours answer; any other order is counted."""
    if all(map(le, steps, steps[1:])):
        last = len(steps) - 1

        def shares(index: int) -> bool:
            step = steps[index]
            return (index > 0 and steps[index - 1] == step) or (
                index < last and steps[index + 1] == step
            )

        return shares
    every = Counter(steps)
    return lambda index: every[steps[index]] != 1


def _adds_only(loop: Kernel) -> bool:
    """A loop of nothing but adds: codegen may run it as shared add kernels over whole arrays
    (codegen/render/add_chains.py: the sum written first, the later terms added to it), which
    would overwrite a product read as a later term before it is read. (Each list walked
    apart, the first other op ends it: asked of every GEMM epilogue of every plan lowered.)"""
    for n in loop.nodes:
        if n.op != "add":
            return False
    for n in loop.recomputed:
        if n.op != "add":
            return False
    return True


def _in_place_candidates(value: Value, kernel: Kernel, last, step_of) -> tuple:
    """Inputs of a loop kernel read element for element (same shape, no broadcast, not a view)
    whose last read is this kernel: value may overwrite them as it goes."""
    if not IN_PLACE or kernel.kind != "loop" or value in kernel.reductions:
        return ()
    shape = internal_shape(kernel.shape)
    identity = list(range(len(shape)))
    maps: dict[Value, list] = {}
    for node in kernel.all_nodes:
        for inp in node.inputs:
            base, dims = index_map(inp, shape)
            maps.setdefault(base, []).append(dims)
    return tuple(
        base
        for base, all_dims in maps.items()
        if base in step_of
        and base not in kernel.all_nodes
        and base.type == value.type
        and all(d == identity for d in all_dims)
        and base.op not in ("transpose", "slice")
        and last.get(base) == step_of[value]
    )


def _reuse_saved(requests, private_saved, last, layout) -> list:
    """Put the largest temporaries into dead private saved buffers, one per lifetime slot."""
    if not private_saved:
        return requests  # nothing to reuse (value_and_grad's joint plan, every forward plan)
    occupied: dict[Value, list[tuple[int, int]]] = {s: [] for s in private_saved}
    remaining = []
    for r in sorted(requests, key=lambda r: -r.nbytes):
        home = next(
            (
                s
                for s in private_saved
                if s.dtype == r.dtype
                and s.type.nbytes >= r.nbytes
                and last.get(s, -1) < r.first_step
                and all(b < r.first_step or a > r.last_step for a, b in occupied[s])
            ),
            None,
        )
        if home is None:
            remaining.append(r)
            continue
        occupied[home].append((r.first_step, r.last_step))
        layout.reused_saved[r.key] = home
    order = {id(r): i for i, r in enumerate(requests)}
    return sorted(remaining, key=lambda r: order[id(r)])
