"""The pages of backplan's GEMM packing buffers a plan's products write, which its peak counts
(category `packing`, ir/gemm_packing.py) and the checked mode reads back (codegen/run/
packing_check.py).

Each thread running backplan's GEMM packs into a buffer of the kept slots (scratch.py: one
page-aligned mapping each, never unmapped, only written pages resident): op(A)'s block at the
buffer's start, op(B)'s after the largest A block, the edge tile after the largest B block
(driver.workspace_sizes; the bfloat16 dot-product GEMM's k-pair panels the same way,
dot_driver.dot_workspace_sizes; the narrow GEMM its B panel where A's block goes, its last rows
where B's does and its tile where the tile does). Per product, the byte ranges it writes there
follow the blocked GEMM's rules (driver.gemm_blocked): A read in place but for a last panel of
fewer than mr rows, B in place under one row block but for a last panel of fewer than nr
columns, a narrow or NT product computed as its transpose (symbols.py), a 16-bit (or float32
beside float64) operand widened while packing, so packed whole; an operand read strided where it
lives (ir/strided_copies.py) in place where its rows have unit stride, else packed whole, as the
driver does; a convolution's product as a matmul of its C-contiguous workspace slices (at the
tile width conv_gemm_width chose). A product with an epilogue over more than MC rows (run MC
rows at a time, B in place) is counted as run whole (B packed: a bound). A size of a symbolic
plan runs the GEMMs its first size chose (_gemm_choices). A thread's buffer holds the pages of
every range written into it; the calling thread's takes every product's, a helper's (a product
shared out, gemm/team.py) only those of shared products: the plan counts the first once and the
second once per helper. So the figure depends on the threads a product is shared between
(codegen/flags.threads(), when the plan is made), and explain says so.

>>> bounds(64, 512, 300, 4, (8, 32), (256, 128, 2048))  # 64 x 256 and 256 x 512 floats
(65536, 524288, 4096)
"""

from __future__ import annotations

from dataclasses import dataclass

from backplan.codegen.flags import threads
from backplan.codegen.kernels.gemm import isa
from backplan.codegen.kernels.gemm.choice import ROW_DOTS, conv_gemm_width, use_own_gemm
from backplan.codegen.kernels.gemm.dot_kernel import DOT_MR, DOT_NR
from backplan.codegen.kernels.gemm.driver import KC, LARGE_B_BYTES, MC, NC
from backplan.codegen.kernels.gemm.isa import vector_width
from backplan.codegen.kernels.gemm.kernel import TILES
from backplan.codegen.kernels.gemm.narrow import NARROW_LANES, NARROW_ROWS, ROW_DOT_COLUMNS
from backplan.codegen.kernels.gemm.scratch import MAPPED_BYTES, PAGE
from backplan.ir import gemm_packing
from backplan.ir.strided_copies import operand_strides

_HALF = ("bf16", "f16")


@dataclass(frozen=True)
class PackingPlan:
    """The pages a plan's products write into the kept buffers: `first` (page indices of the
    calling thread's buffer), `shared` (of each helper's), `helpers` (threads beside the
    caller a product is shared with), `apart` (bytes a narrow product allocates for itself
    where its panel outgrows the buffer's part)."""

    first: frozenset = frozenset()
    shared: frozenset = frozenset()
    helpers: int = 0
    apart: int = 0

    @property
    def per_thread(self) -> tuple[int, int]:
        """(calling thread's bytes, each helper's bytes)."""
        return len(self.first) * PAGE, len(self.shared) * PAGE

    @property
    def nbytes(self) -> int:
        first, shared = self.per_thread
        return first + self.helpers * shared + self.apart


def planned_packing(lowered) -> PackingPlan:
    """The PackingPlan of a lowered plan, each matmul's GEMM chosen as its emitter chooses it
    (own_gemm_chosen: the shape, the CPU, BLAS's threads, 16-bit or strided operands; the
    narrow GEMM: narrow_gemm_chosen; for a size of a symbolic plan, as its first size chose
    them: _gemm_choices). Kept on the plan as first worked out (the memory planner asks it
    for every plan it weighs): Numba's thread count is per thread, and explain, the planner
    and the compiled plan's checked mode, which may ask from different threads, must count
    the same bytes."""
    memo = lowered.packing
    if not memo:
        memo[0] = _plan(lowered.plan.graph.nodes, lowered.layout.workspaces, _gemm_choices(lowered))
    return memo[0]


def planned_packing_bytes(lowered) -> int:
    return planned_packing(lowered).nbytes


def in_place_packing_bytes(node, operands) -> int:
    """gemm_packing.in_place_packing_bytes: pages the product writes reading its operands
    where they live (one thread, run whole), less those it writes on C-contiguous copies
    (none where its shape runs on BLAS; the GEMM chosen by shape alone, gemm/choice.py)."""
    m, n = node.shape
    k = node.inputs[0].shape[-1]
    if not (m and n and k):
        return 0
    (ta, a_strides), (tb, b_strides) = operands
    size, width = (8 if node.dtype == "f64" else 4), vector_width()
    unit = (a_strides[-1] == 1, b_strides[-1] == 1)
    in_place = _pages(_blocked_ranges(m, n, k, ta, tb, size, width, nt=size == 4, unit=unit))
    copied = set()
    if use_own_gemm(m, n, k, tb, node.dtype, trans_a=ta):
        copied = _pages(_blocked_ranges(m, n, k, ta, tb, size, width, nt=size == 4))
    return max(0, len(in_place) - len(copied)) * PAGE


gemm_packing.register(planned_packing_bytes, in_place_packing_bytes)


def _gemm_choices(lowered) -> list | None:
    """For a size of a symbolic plan (ir/symbolic.py): (own GEMM?, its parts, narrow GEMM?)
    of each matmul, in graph order, as the plan's first size chose them, which its driver
    replays at every size (codegen/render/choices.py: a product of 7 rows runs the GEMM the
    first size's 5 rows chose, and writes its pages); kept in the sizes' shared dict. None
    for any other plan (chosen for its own shapes)."""
    shared = lowered.plan.shared
    if shared is None:
        return None
    key = ("gemm_packing", lowered.private_saved)
    found = shared.get(key)
    if found is None:
        from backplan.ir.lowering import lower

        first = shared.get("first")
        plan = first() if first is not None else None
        source = lowered if plan is None else lower(plan, lowered.private_saved)
        found = shared.setdefault(key, _free_choices(source.plan.graph.nodes))
    matmuls = sum(1 for node in lowered.plan.graph.nodes if node.op == "matmul")
    return found if len(found) == matmuls else None


def _free_choices(nodes) -> list[tuple[bool, int, bool]]:
    """(own GEMM?, parts, narrow GEMM?) of each matmul of `nodes`, chosen for its shape."""
    from backplan.codegen.render.choices import pinned
    from backplan.codegen.render.opaque import (
        OpEmitter,
        narrow_gemm_chosen,
        own_gemm_chosen,
        own_gemm_parts,
    )

    found = []
    with pinned(None):  # asked while a plan renders: not one of its pinned choices
        for node in nodes:
            if node.op != "matmul":
                continue
            own = own_gemm_chosen(OpEmitter, node)
            narrow = not own and len(node.inputs[0].shape) == 2
            narrow = narrow and narrow_gemm_chosen(OpEmitter, node)
            found.append((own, own_gemm_parts(node) if own else 1, narrow))
    return found


def _plan(nodes, workspaces=None, choices=None) -> PackingPlan:
    from backplan.ir.strided_copies import reads_strided_operand

    first: set[int] = set()
    shared: set[int] = set()
    helpers = apart = 0
    choices = iter(_free_choices(nodes) if choices is None else choices)
    for node in nodes:
        if node.op != "matmul":
            continue
        own, parts, narrow = next(choices)
        if 0 in node.shape or 0 in node.inputs[0].shape[-1:]:
            continue
        if own:
            strided = reads_strided_operand(node)
            ranges = _own_ranges(node, strided)
            if len(node.shape) > 2 and parts > 1:
                parts = min(threads(), _batch(node))
            first |= _pages(ranges)  # also what the product writes run whole
            chunked = _chunk_ranges(node, ranges, parts) if parts > 1 else None
            if chunked is not None:  # each chunk (gemm/team.py) in any thread's buffer
                chunks = _pages(chunked)
                first |= chunks
                shared |= chunks
                helpers = max(helpers, parts - 1)
        elif narrow:
            ranges, outside = _narrow_ranges(node)
            first |= _pages(ranges)
            apart = max(apart, outside)
    for m, n, k, ta, tb, size, width in _own_conv_products(nodes):
        first |= _pages(_blocked_ranges(m, n, k, ta, tb, size, width))
    for products, size, slots in _own_attention_products(nodes, workspaces or {}):
        width = vector_width()
        pages = _pages([r for p in products for r in _blocked_ranges(*p, size, width)])
        first |= pages
        if slots > 1:  # one thread a slot, each packing in a buffer of its own
            shared |= pages
            helpers = max(helpers, slots - 1)
    return PackingPlan(frozenset(first), frozenset(shared), helpers, apart)


def _batch(node) -> int:
    count = 1
    for d in node.shape[:-2]:
        count *= d
    return count


def _own_ranges(node, strided: bool, shape=None) -> list[tuple[int, int]]:
    """Byte ranges of a kept buffer one product on the blocked GEMM writes (shape: C's block
    a chunk of it computes, gemm/team.py; the whole C by default)."""
    from backplan.codegen.render.opaque import OpEmitter

    m, n = shape or node.shape[-2:]
    k = node.inputs[0].shape[-1]
    ta, tb = (OpEmitter.absorbs(v) for v in node.inputs)
    kinds = tuple(v.dtype for v in node.inputs)
    width = vector_width()
    if kinds[0] == kinds[1] == "bf16" and isa.bf16_gemm_path() == "dot":
        return _dot_ranges(m, n, k)
    size = 8 if node.dtype == "f64" else 4
    if strided:  # read where it lies (matmul.own_gemm_strided_at): rows of unit stride or not
        (_, a_strides), (_, b_strides) = operand_strides(node)
        unit = (a_strides[-1] == 1, b_strides[-1] == 1)
        return _blocked_ranges(m, n, k, ta, tb, size, width, nt=size == 4, unit=unit)
    if kinds[0] == kinds[1]:  # one GEMM entry of that dtype (16-bit ones widen both)
        wide = kinds[0] in _HALF
        return _blocked_ranges(m, n, k, ta, tb, size, width, (wide, wide), not wide)
    # mixed (symbols.py): the narrower operand widened while packing; with B the narrower
    # the entry computes C.T = op(B).T @ op(A).T, the narrower first
    if _narrower(kinds[1], node.dtype):
        return _blocked_ranges(n, m, k, not tb, not ta, size, width, (True, False), False, False)
    return _blocked_ranges(m, n, k, ta, tb, size, width, (True, False), False, False)


def _narrower(kind: str, result: str) -> bool:
    """Whether an operand of dtype kind is narrower than the product's result (widened)."""
    return kind in _HALF or (kind == "f32" and result == "f64")


def _chunk_ranges(node, whole: list, parts: int) -> list[tuple[int, int]] | None:
    """The ranges the chunks of a product shared between `parts` threads write (team._split:
    rows of C, at most MC of them where B is read in place, unless B is LARGE_B_BYTES or more:
    columns of C then, as where B is packed); `whole` where
    the chunks are not modelled (strided operands; no futexes: blocks of gemm/parallel.py),
    a bound; None where the product is too small to cut (it runs whole, no helper)."""
    from backplan.codegen.kernels.atomics import FUTEX_AVAILABLE
    from backplan.codegen.kernels.gemm.team import CHUNKS_PER_THREAD
    from backplan.codegen.render.opaque import OpEmitter
    from backplan.ir.strided_copies import reads_strided_operand

    if reads_strided_operand(node):  # chunks of other shapes: both packed whole, a bound
        m, n = node.shape
        k, size, width = node.inputs[0].shape[-1], 8 if node.dtype == "f64" else 4, vector_width()
        return whole + _whole(m, n, k, size, width) + _whole(n, m, k, size, width)
    if len(node.shape) != 2 or not FUTEX_AVAILABLE:
        return whole
    m, n = node.shape
    tb = OpEmitter.absorbs(node.inputs[1])
    size = 8 if node.dtype == "f64" else 4
    mr, nr = _tile(vector_width(), size)
    b_in_place = not tb and node.inputs[1].dtype == node.dtype
    shared_b = b_in_place and node.inputs[0].shape[-1] * n * size < LARGE_B_BYTES
    pieces = parts * CHUNKS_PER_THREAD
    if m >= 2 * mr and (shared_b or m >= n or n < 2 * nr):
        step = _up(-(-m // pieces), mr)
        step = min(step, MC) if b_in_place else step
        shapes = {(step, n)} | ({(m % step, n)} if m % step else set())
        chunks = -(-m // step)
    else:
        step = _up(-(-n // pieces), nr)
        shapes = {(m, step)} | ({(m, n % step)} if n % step else set())
        chunks = -(-n // step)
    if chunks < 2:  # run whole on the calling thread (team.gemm_team)
        return None
    return [r for shape in shapes for r in _own_ranges(node, False, shape)]


def _blocked_ranges(
    m, n, k, ta, tb, size, width, wide=(False, False), nt=True, swappable=True, unit=(True, True)
) -> list[tuple[int, int]]:
    """driver.gemm_blocked's writes for a product after symbols._gemm_at_addresses's
    transposes (swappable: A and B of one dtype; nt: all three float32). wide: whether A, B
    are widened while packing; unit: whether the matrices A and B are read from have rows of
    unit stride (a strided view's may not): either way not read in place, so packed whole."""
    mr, nr = _tile(width, size)
    c_rows = True  # C row-major; computed as its transpose, every tile through the edge tile
    if swappable and ta and not tb and n < nr <= m:  # a narrow C of A.T @ B: C.T = B.T @ A
        m, n, wide, unit, c_rows = n, m, wide[::-1], unit[::-1], n == 1
    elif nt and size == 4 and unit[1] and _transpose_nt(width, ta, tb, m, n, k, nr):
        m, n, tb, unit = n, m, True, unit[::-1]  # C.T = B @ A.T
    packed = (wide[0] or not unit[0], wide[1] or not unit[1])
    b_off, t_off = _offsets(width, size)
    kc = min(k, KC)
    rows = _blocks(m, MC)
    if packed[0]:
        packed_rows = any(mc % mr for mc in rows)
        ranges = [(0, _up(min(m, MC), mr) * kc * size)]
    else:
        packed_rows = any(_packs_rows(width, mr, mc) for mc in rows)
        ranges = [(0, mr * kc * size)] if packed_rows else []
    in_place = m <= MC and not tb and not packed[1] and (width != 256 or m <= 64)
    cols = _blocks(n, NC)
    if not in_place:
        ranges.append((b_off, b_off + _up(min(n, NC), nr) * kc * size))
    else:
        for nc in cols:
            if nc % nr:
                last = nc - nc % nr
                ranges.append((b_off + last * kc * size, b_off + (last + nr) * kc * size))
    if packed_rows or not c_rows or any(nc % nr for nc in cols):
        ranges.append((t_off, t_off + mr * nr * size))
    return ranges


def _transpose_nt(width, ta, tb, m, n, k, nr) -> bool:
    """symbols._transpose_nt for C-contiguous operands."""
    return (
        width == 512 and not ta and tb and nr <= m < n
        and k * (n - m) >= m * n * ((k + KC - 1) // KC)
    )  # fmt: skip


def _packs_rows(width, mr, mc) -> bool:
    """Whether a row block of mc rows, A in place, packs its last rows (driver.four_row_start:
    the 256-bit tile runs a last 2 or 4 in place)."""
    left = mc % mr
    if not left:
        return False
    return not (width == 256 and mr == 6 and left in (2, 4) and mc >= (8 if left == 2 else 4))


def _whole(m, n, k, size, width) -> list[tuple[int, int]]:
    """A's block, B's block and the tile, all packed (a bound)."""
    mr, nr = _tile(width, size)
    a, b, t = bounds(m, n, k, size, (mr, nr), (KC, MC, NC))
    b_off, t_off = _offsets(width, size)
    return [(0, a), (b_off, b_off + b), (t_off, t_off + t)]


def _dot_ranges(m, n, k) -> list[tuple[int, int]]:
    """dot_driver.gemm_blocked_dot: both operands packed in k pairs (4 bytes a pair)."""
    pairs = (min(k, KC) + 1) // 2
    a_size, b_size = _dot_sizes()
    ranges = [
        (0, _up(min(m, MC), DOT_MR) * pairs * 4),
        (a_size * 2, a_size * 2 + _up(min(n, NC), DOT_NR) * pairs * 4),
    ]
    if any(mc % DOT_MR for mc in _blocks(m, MC)) or any(nc % DOT_NR for nc in _blocks(n, NC)):
        t_off = (a_size + b_size) * 2
        ranges.append((t_off, t_off + DOT_MR * DOT_NR * 4))
    return ranges


def _narrow_ranges(node) -> tuple[list[tuple[int, int]], int]:
    """narrow.narrow_gemm_at's writes (its B panel or columns, its last rows, its tile) at
    narrow_parts' offsets, and the bytes it allocates instead where they do not fit."""
    from backplan.codegen.render.opaque import OpEmitter

    m, n = node.shape
    k = node.inputs[0].shape[-1]
    tb = OpEmitter.absorbs(node.inputs[1])
    parts = narrow_parts(m, n, k, bool(tb))
    if parts is None:
        return [], sum(length for _, length in narrow_needs(m, n, k, bool(tb)))
    return [(start, start + length) for start, length in parts if length], 0


def narrow_needs(m, n, k, trans_b) -> list[tuple[str, int]]:
    """(part, bytes) the narrow GEMM works in: "a" its B panel (k x 16) or B's columns as rows
    (n x k, where C is at most ROW_DOT_COLUMNS wide and B not transposed), "b" its last rows
    (fewer than NARROW_ROWS, zero padded), "tile" its 16-wide tile."""
    if n <= ROW_DOT_COLUMNS:
        return [("a", 0 if trans_b else n * k * 4)]
    return [
        ("a", max(k, 1) * NARROW_LANES * 4),
        ("b", NARROW_ROWS * max(k, 1) * 4 if m % NARROW_ROWS else 0),
        ("tile", NARROW_ROWS * NARROW_LANES * 4),
    ]


def narrow_parts(m, n, k, trans_b) -> list[tuple[int, int]] | None:
    """(byte offset in a kept buffer, bytes) of each of narrow_needs' parts, at the float32
    layout's A, B and tile offsets; None where one outgrows its part (it allocates then)."""
    b_off, t_off = _offsets(512, 4)
    starts = {"a": (0, b_off), "b": (b_off, t_off), "tile": (t_off, MAPPED_BYTES)}
    found = []
    for part, length in narrow_needs(m, n, k, trans_b):
        start, stop = starts[part]
        if start + length > stop:
            return None
        found.append((start, length))
    return found


def _offsets(width, size) -> tuple[int, int]:
    """Byte offsets of the B part and the tile in a kept buffer (symbols._kept_workspace)."""
    mr, nr = _tile(width, size)
    a_size = _up(MC, mr) * KC
    b_size = _up(NC, nr) * KC
    return a_size * size, (a_size + b_size) * size


def _dot_sizes() -> tuple[int, int]:
    """dot_driver.dot_workspace_sizes(KC, MC, NC)'s A and B parts, uint16 elements."""
    kc_even = KC + KC % 2
    a_size = _up(_up(MC, DOT_MR) * kc_even, 32)
    b_size = _up(_up(NC, DOT_NR) * kc_even, 32)
    return a_size, b_size


def _blocks(length, block) -> list[int]:
    """The sizes of the blocks a loop of `block` cuts `length` into (each size once)."""
    sizes = {block} if length >= block else set()
    if length % block:
        sizes.add(length % block)
    return sorted(sizes)


def _up(value, step) -> int:
    return -(-value // step) * step


def _pages(ranges) -> set[int]:
    return {
        p
        for start, stop in ranges
        if stop > start
        for p in range(start // PAGE, _up(stop, PAGE) // PAGE)
    }


def _own_conv_products(nodes) -> list:
    """(m, n, k, trans_a, trans_b, item size, tile width) of each convolution's product that
    runs on backplan's GEMM (codegen/kernels/conv.py _product: C-contiguous slices of its
    workspace, the weights' matrix first; the input gradient's transposed, the weight
    gradient's columns transposed), which packs as a matmul of those operands."""
    from backplan.codegen.kernels.conv import _product_shape  # conv imports the GEMM

    found = []
    for node in nodes:
        if node.op in ("conv2d", "conv2d_input_grad", "conv2d_weight_grad"):
            m, n, k = _product_shape(node, node.op)
            ta, tb = node.op == "conv2d_input_grad", node.op == "conv2d_weight_grad"
            width = conv_gemm_width(m, n, k, node.dtype, trans_b=tb)
            if width > ROW_DOTS and m and n and k:
                found.append((m, n, k, ta, tb, 8 if node.dtype == "f64" else 4, width))
    return found


def _own_attention_products(nodes, workspaces: dict) -> list:
    """(its products' (m, n, k, trans_a, trans_b), item size, slots) of each fused attention
    kernel on backplan's GEMM (BLAS where its variant's width is 0); its slots (ir/
    kernel_workspace.py) are the threads running its pairs."""
    from backplan.codegen.kernels.attention import _variant  # attention imports the GEMM
    from backplan.ir.kernel_workspace import attention_elements

    found = []
    for node in nodes:
        if node.op not in ("attention", "attention_grad") or node not in workspaces:
            continue
        per = attention_elements(node)
        if not per:
            continue  # no rows or no keys: the kernel runs no product
        slots = max(1, workspaces[node][1] // per)
        if not _variant(node.op, node, slots > 1)[1]:
            continue
        found.append((attention_products(node), 8 if node.dtype == "f64" else 4, slots))
    return found


def attention_products(node) -> set[tuple[int, int, int, bool, bool]]:
    """(m, n, k, trans_a, trans_b) of every product an attention kernel runs on one (batch,
    head) pair (codegen/kernels/attention.py): per block of at most ROWS query rows, against
    the keys it sees (all, or under the causal mask those up to its last row), at most KEYS
    of them a tile past KEYS; forward P = Q K^T and P V, backward also dP = G V^T,
    dV += P^T G, dQ = dS K and dK += dS^T Q. Operands with rows of unit stride (C-contiguous
    workspace blocks, rows of q, k, v, g and their gradients)."""
    from backplan.ir.kernel_workspace import KEYS, ROWS, attention_dims

    _, length, keys, d, dv = attention_dims(node)
    grad, causal = node.op == "attention_grad", bool(node.attrs.get("causal"))
    found = set()
    for first in range(0, length, ROWS):
        rows = min(ROWS, length - first)
        seen = min(first + rows, keys) if causal else keys
        tiles = [min(KEYS, seen - s) for s in range(0, seen, KEYS)] if keys > KEYS else [seen]
        for cols in set(tiles):
            found |= {(rows, cols, d, False, True), (rows, dv, cols, False, False)}
            if grad:
                found |= {
                    (rows, cols, dv, False, True),
                    (cols, dv, rows, True, False),
                    (rows, d, cols, False, False),
                    (cols, d, rows, True, False),
                }
    return {p for p in found if p[0] and p[1] and p[2]}


def bounds(m: int, n: int, k: int, size: int, tile: tuple, blocks: tuple) -> tuple:
    """(A part, B part, tile) bytes one thread packs for an m x n x k product, page-rounded:
    A's block of min(m, MC) rows rounded up to the tile's mr, B's of min(n, NC) columns
    rounded up to nr, both min(k, KC) deep."""
    mr, nr = tile
    kc, mc, nc = blocks
    depth = min(k, kc)
    if not (m and n and k):
        return 0, 0, 0
    rows = -(-min(m, mc) // mr) * mr
    cols = -(-min(n, nc) // nr) * nr
    return _round(rows * depth * size), _round(cols * depth * size), _round(mr * nr * size)


def _tile(width: int, size: int) -> tuple:
    lanes, mr, nv = TILES[width]["f32" if size == 4 else "f64"]
    return mr, lanes * nv


def _round(nbytes: int) -> int:
    return _up(nbytes, PAGE)
