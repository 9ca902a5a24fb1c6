"""Emitting one fused loop nest: index maps through aliases and broadcasting, collapsing of
dimensions every access treats alike, reduction tails, and the choice of prange."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from backplan.codegen.flags import parallel_pays
from backplan.codegen.render.choices import chosen
from backplan.codegen.render.loop_template import TEMPLATES_KEPT, template_key
from backplan.codegen.render.placement import Placement
from backplan.codegen.render.scalar import NP_TYPE, expression, literal
from backplan.ir.fusion import Kernel, alias_base, index_map, internal_shape
from backplan.ir.graph import Value
from backplan.ir.rounding_points import float32_source
from backplan.ir.row_local import CHUNKS  # a parallel row loop's chunks of rows
from backplan.ir.types import is_half, np_dtype

# reductions across a parallel row loop: one partial row per chunk; a value the loop keeps a
# row at a time: chunk c in row c of its buffer (view group CHUNK_ROW, indexed by the chunk)
CHUNK_ROW = "chunk"


@dataclass
class Access:
    name: str
    dims: list[int | None]  # per dimension of the array: loop dimension or None
    shape: tuple[int, ...]
    where: Placement  # the base array, offset and strides the kernel makes its view from
    itemsize: int
    # not C-contiguous (transpose, slice): indexed in full through strides, never merged
    strided: bool = field(init=False)

    def __post_init__(self) -> None:
        self.strided = not self.where.contiguous


@dataclass
class RowPartials:
    """A row stage's reductions over the rows: lines before the chunked loop over rows (the
    partial arrays), at the start and end of each chunk, after it (the combination), and where
    each column reduction accumulates (a whole reduction uses its register accumulator)."""

    before: list = field(default_factory=list)
    chunk_start: list = field(default_factory=list)
    chunk_end: list = field(default_factory=list)
    after: list = field(default_factory=list)
    targets: dict = field(default_factory=dict)


def equal_values(run: list) -> dict:
    """value -> an equal value computed before it in these loops (a row kernel's stages, in
    order): the same op with the same attributes on equal inputs. The joint plan's
    rematerialisation copies cheap chains (a row's mean, x - mean, ...) into the gradient part so
    as not to hold them; where the copy and its original run in one row kernel, both are row
    statistics stored under two names and each chain was computed twice. Reductions are left
    out (an equal sum in another loop may add in another order), and 16-bit values (a loop may
    round a tanh it only rounds with the cheaper rational one)."""
    first: dict = {}
    equal: dict = {}
    for kernel in run:
        if kernel.kind != "loop":
            continue
        for node in kernel.recomputed + kernel.nodes:
            if is_half(node.dtype) or node in equal:
                continue
            inputs = tuple(equal.get(i, i) for i in node.inputs)
            key = (node.op, repr(sorted(node.attrs.items())), node.dtype, node.shape, inputs)
            seen = first.setdefault(key, node)
            if seen is not node:
                equal[node] = seen
    return equal


@dataclass
class LoopEmitter:
    """Builds the source of one loop kernel. Every array it reads or writes is a view the
    kernel makes itself from a base array, an offset and sizes (and strides) it takes as
    arguments: the plan's driver only passes them (codegen/render/placement.py)."""

    kernel: Kernel
    local: set  # values computed by this kernel
    stored: set  # values of this kernel that must be written to their buffers
    array_name: dict  # value -> variable name ("v3"); locals of the loop use "t3"
    literal_of: callable  # value -> literal source, or None when not a literal
    place: callable = None  # value -> Placement of its array
    accesses: dict = field(default_factory=dict)
    rows: bool = False  # a stage of a row kernel: the caller loops over axis 0 (as i0)
    size_prefix: str | None = None  # loop sizes become arguments named <prefix><level>
    same: dict = field(default_factory=dict)  # value -> the local of an equal one computed first
    # float32 values read from buffers whose 16-bit rounding this loop skips where it only
    # widens it back (a GEMM's result in its epilogue: x @ w + b is rounded once, when stored)
    unrounded: frozenset = frozenset()
    row_partials: RowPartials | None = None  # a row stage's reductions over rows (emit)
    row_chunks: bool = False  # a row stage whose caller runs the rows in parallel chunks
    # values kept one row at a time (a row stage; ir/row_local.py): the first row of their
    # buffer, or in parallel chunks (row_chunks) row `chunk`
    row_local: set = field(default_factory=set)
    # a row stage's reads of one element per row (a row's mean, its 1/std), read once before
    # the stage's loops over columns: read text -> the local holding it (_nest fills it)
    row_reads: dict | None = None
    # value -> an equal value computed earlier in the same row kernel (equal_values): where
    # this stage reads both, it reads that one, so a rematerialised chain computes once
    equal: dict = field(default_factory=dict)
    # value -> the local an earlier stage of the same row kernel holds its row's element in
    # (row_values): read from there, not stored and loaded back through the arena
    row_values: dict = field(default_factory=dict)
    # a symbolic plan's loop lines by what they read of a size (codegen/render/loop_template.py),
    # shared by its sizes; None: rendered afresh
    templates: dict | None = None

    def size(self, level: int) -> str:
        """A loop's trip count in the source: a name the kernel takes as an argument, so one
        compiled kernel serves every size; a size of 1 stays a literal (it removes a loop)."""
        if self.size_prefix is None or self.sizes[level] == 1:
            return str(self.sizes[level])
        if self.rows and level == 0:
            return "n0"  # the rows: the size of the caller's loop
        return f"{self.size_prefix}{level}"

    def size_arguments(self) -> dict[str, int]:
        """Names of the sizes the loop lines use, with their values."""
        if self.size_prefix is None:
            return {}
        return {self.size(g): n for g, n in enumerate(self.sizes) if n != 1}

    def emit(self) -> tuple[list[str], list[str], bool]:
        """(view lines, loop lines, parallel?): both are the kernel's, view lines first."""
        shape = self.loop_shape = internal_shape(self.kernel.shape)
        self.active = [d for d, size in enumerate(shape) if size != 1 or (self.rows and d == 0)]
        self._collect_accesses(shape)
        self.groups = self._collapse(shape)
        self.sizes = [math.prod(shape[d] for d in group) for group in self.groups]
        if self.rows:  # the row loop is the caller's; emit the rest for row i0
            setup = self._views()
            self.row_partials = self._row_partials(self.row_chunks)
            return setup, self._nest("serial", 1, self.row_partials.targets), False
        mode = self._mode()
        key = None if self.templates is None else template_key(self, mode)
        found = None if key is None else self.templates.get(key)
        if found is not None:  # another size's lines: this size's sizes, offsets, strides
            self._arguments()
            return list(found[0]), list(found[1]), mode != "serial"
        setup = self._views()
        body = self._nest(mode) if mode != "chunked" else self._chunked_nest()
        if key is not None and len(self.templates) < TEMPLATES_KEPT:
            self.templates[key] = (tuple(setup), tuple(body))
        return setup, body, mode != "serial"

    def _collect_accesses(self, shape) -> None:
        self.reads = []  # per input of each computed node: (input, access key, literal text)
        for node in self.kernel.computed:
            for inp in node.inputs:
                base, dims = index_map(inp, shape)
                key = (base, tuple(dims))  # one array may be read through several index maps
                lit = self.literal_of(base)
                self.reads.append((inp, key, lit))
                if base in self.local or lit is not None:
                    continue
                if key not in self.accesses:
                    self.accesses[key] = self._access(base, dims)
        for node in self.kernel.nodes:
            if node in self.stored:
                self.accesses[node] = self._access(node, list(range(len(shape))))
        self.reduced_dims = {}
        for red in self.kernel.reductions:
            axes = set(red.attrs["axes"])
            kept = [d for d in range(len(shape)) if d not in axes]
            if red.attrs["keepdims"]:
                dims = [d if d not in axes else None for d in range(len(shape))]
            else:
                dims = kept
            self.accesses[red] = self._access(red, dims or [None])
            self.reduced_dims[red] = axes

    def _access(self, value, dims) -> Access:
        shape = internal_shape(value.shape)
        itemsize = np_dtype(value.dtype).itemsize
        return Access(self.array_name[value], dims, shape, self.place(value), itemsize)

    def _collapse(self, shape) -> list[list[int]]:
        def signature(d):
            # a strided access keeps each of its dimensions as its own loop; "absent" is a
            # string, never False: loop dimension 0 equals False and would merge with one the
            # access broadcasts over (then read with dimension 0's stride)
            present = tuple(
                (d if a.strided else "all") if d in a.dims else "absent"
                for a in self.accesses.values()
            )
            reduced = tuple(d in axes for axes in self.reduced_dims.values())
            row = (self.rows and d == 0,)  # a row kernel keeps axis 0 as its own loop
            return present + reduced + row

        groups: list[list[int]] = []
        last = None  # the signature of the last dim grouped (each dim's worked out once)
        for d in self.active:
            this = signature(d)
            if groups and groups[-1][-1] == d - 1 and last == this:
                groups[-1].append(d)
            else:
                groups.append([d])
            last = this
        return groups or [[0]]

    def _views(self) -> list[str]:
        """One view per access, made inside the kernel from base `b<j>` at offset `o<j>`
        (strides `d<j>_<axis>` in bytes when strided); their values are in `self.scalars`."""
        self._arguments()
        lines, self.view_name, self.view_groups = [], {}, {}
        prefix = self.size_prefix[:-1] if self.size_prefix else ""
        shared = self.shared_views()
        for j, (key, access) in enumerate(self.accesses.items()):
            base, offset, view = f"{prefix}b{j}", f"{prefix}o{j}", f"{prefix}w{j}"
            first = shared.get(key)
            if first is not None:
                # a result written over the buffer it reads (a GEMM's epilogue over its
                # product, ir/layout.py): one view for both, so LLVM sees one array, not two
                # it must check for overlap at run time (then running the loop scalar: 1.39x
                # a 3-layer tanh MLP's step)
                self.view_name[key] = self.view_name[first]
                self.view_groups[key] = self.view_groups[first]
                continue
            self.view_name[key] = view
            if access.strided:
                groups = [self._group_of(d) for d in access.dims]
                lines.append(f"{view} = {self._strided_view(access, groups, prefix, j)}")
                self.view_groups[key] = groups
                continue
            present = [
                g for g, group in enumerate(self.groups) if any(d in access.dims for d in group)
            ]
            value = key if isinstance(key, Value) else key[0]
            sizes = [self.size(g) for g in present] or ["1"]
            statistic = internal_shape(value.shape)[1:] == (1,) and 0 in access.dims
            if value in self.row_local and (access.dims == [0, 1] or statistic):
                # the current row only: the view is one row (one element for a row statistic)
                present = [] if statistic else present[1:]
                sizes = [self.size(g) for g in present]
                if self.row_chunks:  # a row per chunk of rows, indexed by the chunk
                    present, sizes = [CHUNK_ROW, *present], [str(CHUNKS), *sizes]
                sizes = sizes or ["1"]
            lines.append(f"{view} = contiguous_view({base}, {offset}, ({', '.join(sizes)},))")
            self.view_groups[key] = present
        return lines

    def shared_views(self) -> dict:
        """Access -> the earlier access whose view it reads and writes through: the same
        placement and loop dimensions, neither strided (a GEMM's epilogue result written over
        its product, ir/layout.py)."""
        first: dict = {}
        shared = {}
        for key, access in self.accesses.items():
            if access.strided:
                continue
            where = (access.where, tuple(access.dims))
            if where in first:
                shared[key] = first[where]
            else:
                first[where] = key
        return shared

    def _arguments(self) -> None:
        """Each view's base array (self.bases), offset and strides in bytes (self.scalars), by
        the names _views gives them."""
        self.scalars, self.bases = {}, {}
        prefix = self.size_prefix[:-1] if self.size_prefix else ""
        for j, access in enumerate(self.accesses.values()):
            self.bases[f"{prefix}b{j}"] = access.where.base
            self.scalars[f"{prefix}o{j}"] = access.where.offset
            if not access.strided:
                continue
            for axis, dim in enumerate(access.dims):
                if self._group_of(dim) is not None:
                    stride = access.where.strides[axis] * access.itemsize
                    self.scalars[f"{prefix}d{j}_{axis}"] = stride

    def _strided_view(self, access, groups, prefix: str, j: int) -> str:
        shape, strides = [], []
        for axis, group in enumerate(groups):
            if group is None:  # indexed at 0 only
                shape.append("1")
                strides.append("0")
                continue
            name = f"{prefix}d{j}_{axis}"
            shape.append(self.size(group))
            strides.append(name)
        return (
            f"strided_view({prefix}b{j}, {prefix}o{j}, "
            f"({', '.join(shape)},), ({', '.join(strides)},))"
        )

    def _crossing(self) -> list:
        """Reductions over the outermost loop: threads splitting that loop would race."""
        return [r for r in self.kernel.reductions if set(self.groups[0]) & self.reduced_dims[r]]

    def _mode(self) -> str:
        """serial; parallel (prange over the outer loop); or chunked: prange over chunks of the
        outer loop, each reducing into its own partial row, combined at the end."""
        # asked only where no earlier size's choice is pinned (its comparisons of this size's
        # numbers would be guards of a rendering as a substitution: render/substitution.py)
        serial = chosen(
            "serial_loop",
            lambda: not parallel_pays(math.prod(self.sizes)) or self.sizes[0] < 2,
        )
        if serial:
            return "serial"
        return "chunked" if self._crossing() else "parallel"

    def _chunked_nest(self) -> list[str]:
        crossing = self._crossing()
        depth_of = {r: self._suffix_depth(r) for r in self.kernel.reductions}
        lines, partial = [], {}
        for red in crossing:
            kept = [g for g in self.view_groups[red] if g is not None]
            sizes = [self.size(g) for g in kept] or ["1"]
            partial[red] = (f"part_{self.array_name[red]}", kept, " * ".join(sizes))
            shape = ", ".join([str(CHUNKS), *sizes])
            lines.append(f"{partial[red][0]} = np.empty(({shape}), {NP_TYPE[red.dtype]})")
        lines.append(f"for chunk in prange({CHUNKS}):")
        lines.append(f"    lo = chunk * {self.size(0)} // {CHUNKS}")
        lines.append(f"    hi = (chunk + 1) * {self.size(0)} // {CHUNKS}")
        targets = {}
        for red in crossing:
            if depth_of[red] == 0:  # reduces everything: a register accumulator per chunk
                continue
            lines.append(f"    {partial[red][0]}[chunk] = {self._init(red)}")
            depth_of[red] = None
            targets[red] = f"{partial[red][0]}[chunk, {self._kept_index(partial[red][1])}]"
        for level in range(len(self.sizes)):
            pad = "    " * (level + 1)
            for red in self.kernel.reductions:
                if depth_of[red] == level:
                    lines.append(f"{pad}acc_{self.array_name[red]} = {self._init(red)}")
            bounds = "lo, hi" if level == 0 else self.size(level)
            lines.append(f"{pad}for i{level} in range({bounds}):")
        pad = "    " * (len(self.sizes) + 1)
        lines += [pad + line for line in self._body(depth_of, targets)]
        for level in reversed(range(len(self.sizes))):
            pad = "    " * (level + 1)
            for red in self.kernel.reductions:
                if depth_of[red] != level:
                    continue
                target = (
                    f"{partial[red][0]}[chunk, 0]"
                    if red in partial
                    else f"{self.view_name[red]}[{self._index(red)}]"
                )
                lines.append(f"{pad}{target} = acc_{self.array_name[red]}")
        for red in crossing:
            name, _, count = partial[red]
            lines += [
                f"flat = {name}.reshape(({CHUNKS}, {count}))",
                f"out = {self.view_name[red]}.reshape(({count},))",
                f"for j in range({count}):",
                f"    acc = {self._init(red)}",
                f"    for chunk in range({CHUNKS}):",
                *["        " + line for line in self._combine(red, "flat[chunk, j]")],
                "    out[j] = acc",
            ]
        return lines

    def _row_partials(self, chunked: bool) -> RowPartials:
        """In a row stage, what its reductions over the rows (a column sum, a whole sum) need
        around the caller's loop over rows, which then runs in chunks (each reducing into its
        own partial row, combined after the loop; RowPartials): a row kernel so keeps a
        layer's parameter gradients in the loop that reads each row once. chunked: the rows
        run in parallel chunks; else in one serial loop, reducing into the outputs."""
        parts = RowPartials()
        for red in self.kernel.reductions:
            if 0 not in self.reduced_dims[red]:
                continue
            if not chunked:
                self._row_totals(red, parts)
                continue
            name = self.array_name[red]
            kept = [g for g in self.view_groups[red] if g is not None]
            count = " * ".join(self.size(g) for g in kept) or "1"
            part, init = f"part_{name}", self._init(red)
            parts.before.append(f"{part} = np.empty(({CHUNKS}, {count}), {NP_TYPE[red.dtype]})")
            if self._suffix_depth(red) == 0:  # every axis reduced: a register per chunk
                parts.chunk_start.append(f"acc_{name} = {init}")
                parts.chunk_end.append(f"{part}[chunk, 0] = acc_{name}")
            else:
                parts.chunk_start.append(f"{part}[chunk] = {init}")
                parts.targets[red] = f"{part}[chunk, {self._kept_flat_index(kept)}]"
            combine = self._combine(red, f"{part}[chunk, j]", f"all_{name}")
            parts.after += [
                f"out_{name} = {self.view_name[red]}.reshape(({count},))",
                f"for j in range({count}):",
                f"    all_{name} = {init}",
                f"    for chunk in range({CHUNKS}):",
                *["        " + line for line in combine],
                f"    out_{name}[j] = all_{name}",
            ]
        return parts

    def _row_totals(self, red, parts: RowPartials) -> None:
        """A reduction over the rows of a serial row kernel: straight into its output (a
        column sum; nothing allocated, so the kernel keeps its address form) or into its
        register accumulator, stored after the loop over rows."""
        name, init = self.array_name[red], self._init(red)
        if self._suffix_depth(red) == 0:
            parts.before.append(f"acc_{name} = {init}")
            parts.after.append(f"{self.view_name[red]}[0] = acc_{name}")
        else:
            parts.before.append(f"{self.view_name[red]}[:] = {init}")
            parts.targets[red] = f"{self.view_name[red]}[{self._index(red)}]"

    def _kept_flat_index(self, groups) -> str:
        """The flat index of a row stage's kept loop groups (at most the one column group)."""
        if len(groups) > 1:
            raise AssertionError("a row stage reduces into at most one column group")
        return f"i{groups[0]}" if groups else "0"

    def _kept_index(self, groups) -> str:
        return ", ".join(f"i{g}" for g in groups) if groups else "0"

    def _combine(self, red, value, acc: str = "acc") -> list[str]:
        if red.op == "sum":
            return [f"{acc} += {value}"]
        return [f"v_ = {value}", f"if v_ > {acc} or v_ != v_:", f"    {acc} = v_"]

    def _group_of(self, dim) -> int | None:
        for g, group in enumerate(self.groups):
            if dim in group:
                return g
        return None

    def _index(self, value) -> str:
        groups = self.view_groups[value]
        words = ("0" if g is None else "chunk" if g == CHUNK_ROW else f"i{g}" for g in groups)
        return ", ".join(words) if groups else "0"

    def _suffix_depth(self, red) -> int | None:
        """Depth at which a scalar accumulator works (reduced groups form a suffix), or None
        (accumulate into the output array), also when only size-1 axes are reduced."""
        reduced = [bool(set(group) & self.reduced_dims[red]) for group in self.groups]
        if True not in reduced:
            return None
        depth = reduced.index(True)
        return depth if all(reduced[depth:]) else None

    def _tail_depth(self, red) -> int | None:
        """Where the innermost run of reduced groups starts, when groups outside it are reduced
        too (no suffix): the run sums in a scalar, added to the output after it (a channel sum
        over batch and positions accumulated through memory at every element: a store-to-load
        chain per element, and no vector code)."""
        reduced = [bool(set(group) & self.reduced_dims[red]) for group in self.groups]
        if not reduced or not reduced[-1] or self._suffix_depth(red) is not None:
            return None
        depth = len(reduced)
        while depth > 0 and reduced[depth - 1]:
            depth -= 1
        return depth

    def _nest(self, mode: str, first_level: int = 0, targets=None) -> list[str]:
        """targets: reductions that accumulate elsewhere (a row stage's partial rows)."""
        parallel = mode == "parallel"
        targets = targets or {}
        lines, depth_of, tails = [], {}, set()
        self._row_depths, self._tails = depth_of, tails
        for red in self.kernel.reductions:
            depth_of[red] = self._suffix_depth(red)
            if red in targets:
                depth_of[red] = None
            elif depth_of[red] is None:
                lines.append(f"{self.view_name[red]}[:] = {self._init(red)}")
                depth_of[red] = self._tail_depth(red)
                if depth_of[red] is not None and depth_of[red] >= first_level:
                    tails.add(red)
                else:
                    depth_of[red] = None
        for level in range(len(self.sizes)):
            if level < first_level:
                continue
            pad = "    " * (level - first_level)
            for red in self.kernel.reductions:
                if depth_of[red] == level:
                    lines.append(f"{pad}acc_{self.array_name[red]} = {self._init(red)}")
            loop = "prange" if parallel and level == 0 else "range"
            lines.append(f"{pad}for i{level} in {loop}({self.size(level)}):")
        pad = "    " * (len(self.sizes) - first_level)
        if self.rows and first_level == 1 and len(self.sizes) > 1:
            self.row_reads = {}
            body = self._body(depth_of, targets)
            lines = [f"{name} = {read}" for read, name in self.row_reads.items()] + lines
            self.row_reads = None
        else:
            body = self._body(depth_of, targets)
        lines += [pad + line for line in body]
        for level in reversed(range(first_level, len(self.sizes))):
            pad = "    " * (level - first_level)
            for red in self.kernel.reductions:
                if depth_of[red] != level:
                    continue
                target = f"{self.view_name[red]}[{self._index(red)}]"
                acc = f"acc_{self.array_name[red]}"
                if red not in tails:
                    lines.append(f"{pad}{target} = {acc}")
                elif red.op == "sum":
                    lines.append(f"{pad}{target} += {acc}")
                else:
                    lines += [pad + line for line in self._combine_into(target, acc)]
        return lines

    @staticmethod
    def _combine_into(target: str, value: str) -> list[str]:
        """max of target and value into target, a NaN winning (as the loop's own compare)."""
        return [f"v_ = {value}", f"if v_ > {target} or v_ != v_:", f"    {target} = v_"]

    def _init(self, red) -> str:
        if red.op == "sum":
            return literal(0, red.dtype)
        if red.dtype in ("f32", "f64"):
            return literal(float("-inf"), red.dtype)
        return f"np.iinfo({NP_TYPE[red.dtype]}).min"

    def operand(self, value) -> str:
        base = alias_base(value)
        if base in self.local:
            return self.local_name(base)
        lit = self.literal_of(base)
        if lit is not None:
            return lit
        key = (base, tuple(index_map(value, self.loop_shape)[1]))
        same = self.equal.get(base)
        if same is not None and (same, key[1]) in self.view_name:  # read here anyway: its text
            key = (same, key[1])  # then matches, and _body computes the chain on it once
        per_row = self.view_groups[key] == [0] or self._row_statistic(key)
        if self.rows and key[0] in self.row_values and per_row:
            return self.row_values[key[0]]
        read = f"{self.view_name[key]}[{self._index(key)}]"
        if self.row_reads is not None and per_row:
            # the stores of the column loops may share the arena with it (to the compiler), so
            # it would be loaded again at every column: once per row instead
            return self.row_reads.setdefault(read, f"row_{self.view_name[key]}")
        return read

    def _row_statistic(self, key) -> bool:
        """Whether a read is of a row statistic kept one row at a time (ir/row_local.py): its
        element of the current row, wherever the row kernel keeps it."""
        return key[0] in self.row_local and self.view_groups[key] in ([], [CHUNK_ROW])

    def _unrounded(self, node) -> str | None:
        """For a widening cast of a 16-bit value this loop computed by rounding a float32 one
        (its own, or one of `unrounded`), that float32 value: a fused chain rounds once, when
        it stores. The rule is ir/rounding_points.py's, which the reference interpreter
        running the lowered plan follows too."""
        source = float32_source(node, self.local, self.unrounded)
        return None if source is None else self.operand(source)

    def _rounded_to_half(self, node) -> bool:
        """Whether this loop's only use of node's float32 value is a rounding into 16 bits (a
        16-bit op computed in float32, ir/widen.py): such a tanh is the cheaper rational one
        (mathlib.tanh_rational_f32: 3e-7 relative, far below a 16-bit half ulp)."""
        if node in self.stored:
            return False
        users = [n for n in self.kernel.recomputed + self.kernel.nodes if node in n.inputs]
        users += [r for r in self.kernel.reductions if node in r.inputs]
        return bool(users) and all(n.op == "astype" and is_half(n.dtype) for n in users)

    def _half_rounded(self, node) -> str | None:
        """The expression of a tanh, or of a gelu with approximate='tanh', whose float32
        value this loop only rounds into 16 bits (None otherwise): the rational tanh, and the
        gelu as x * sigmoid(2u) (kernels/scalar_functions.py: more accurate and cheaper than
        0.5 * x * (1 + tanh(u)), whose cancellation the rational tanh made worse)."""
        cheaper = {"tanh": "tanh_rational_f32", "gelu": "gelu_tanh_sigmoid_f32"}.get(node.op)
        if cheaper is None or node.dtype != "f32":
            return None
        if node.op == "gelu" and node.attrs.get("approximate") != "tanh":
            return None
        if not self._rounded_to_half(node):
            return None
        return f"{cheaper}({self.operand(node.inputs[0])})"

    def row_values_kept(self) -> dict:
        """After emit, for a row stage: value -> the local holding its element of row i0 at the
        row loop's level, for the stages after it (LoopEmitter.row_values). Only float32 and
        float64 values: a 16-bit buffer rounds what it stores, so its value is read back. A
        reduction's accumulator holds the row's result after its loop over columns; a stage
        with no loop of its own computes every value once per row."""
        kept = {}
        if not self.rows:
            return kept
        if len(self.sizes) == 1:
            for node in self.kernel.recomputed + self.kernel.nodes:
                if node.dtype in ("f32", "f64"):
                    kept[node] = self.local_name(node)
        targets = self.row_partials.targets if self.row_partials else {}
        for red in self.kernel.reductions:
            row_level = self._row_depths.get(red) == 1 and red not in self._tails
            if row_level and red not in targets and red.dtype in ("f32", "f64"):
                kept[red] = f"acc_{self.array_name[red]}"
        return kept

    def local_name(self, node) -> str:
        return self.same.get(node) or "t" + self.array_name[node][1:]

    def _body(self, depth_of, targets=None) -> list[str]:
        """Every read comes before every store, so an output may overwrite an input in place.
        targets: where a reduction accumulates, when not its accumulator or output."""
        targets = targets or {}
        lines, computed = [], {}  # expression -> the local holding its value
        for node in self.kernel.recomputed + self.kernel.nodes:
            unrounded = self._unrounded(node)
            if unrounded is not None:  # rounded to 16 bits only where a buffer stores it
                self.same[node] = unrounded
                continue
            expr = self._half_rounded(node) or expression(
                node, [self.operand(i) for i in node.inputs]
            )
            if expr in computed:  # a chain recomputed beside its original: compute it once
                self.same[node] = computed[expr]
                continue
            computed[expr] = self.local_name(node)
            lines.append(f"{self.local_name(node)} = {expr}")
        for node in self.kernel.nodes:
            if node in self.stored:
                lines.append(
                    f"{self.view_name[node]}[{self._index(node)}] = {self.local_name(node)}"
                )
        for red in self.kernel.reductions:
            value = self.operand(red.inputs[0])
            target = targets.get(red) or (
                f"acc_{self.array_name[red]}"
                if depth_of[red] is not None
                else f"{self.view_name[red]}[{self._index(red)}]"
            )
            if red.op == "sum":
                lines.append(f"{target} += {value}")
            else:
                lines.append(f"v_ = {value}")
                lines.append(f"if v_ > {target} or v_ != v_:")
                lines.append(f"    {target} = v_")
        return lines
