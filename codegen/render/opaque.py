"""Source for the nodes that are a call of their own: views, and every opaque op through the
emitter its kernel module registers (codegen/kernels/*.py, `@emits`). OpEmitter is what an
emitter is given: each value's variable, its placement, and the index-error lines."""

from __future__ import annotations

import functools
import importlib
import math
import os
import pkgutil
import sys

from backplan.codegen.flags import threads
from backplan.codegen.kernels.gemm.choice import (
    blas_threads,
    own_parallel_parts,
    use_narrow_gemm,
    use_own_gemm,
)
from backplan.codegen.render.choices import chosen, decide
from backplan.codegen.render.loops import internal_shape
from backplan.codegen.render.scalar import NP_TYPE
from backplan.ir.fusion import alias_base, is_alias
from backplan.ir.graph import Value
from backplan.ir.layout import reads_its_input
from backplan.ir.strided_copies import reads_strided_operand
from backplan.ir.types import is_half

# Index errors are worded at codegen time with holes for what only the data knows.
HOLES = ("{value}", "{position}")


class Unsupported(Exception):
    """A pattern codegen does not compile; the plan then runs on the reference interpreter."""


def size_one_index(before: tuple, after: tuple) -> str | None:
    """The index that makes an array of shape `before` one of shape `after` when they differ
    only by axes of size 1 (`[:, :, 0]` drops one, `[:, None]` adds one): a strided view,
    where a reshape would copy it (Numba reshapes only contiguous arrays). The memory planner
    places such a reshape as a view of its input (ir/strided_copies.py), so a copy here would
    be an allocation no plan counts. None when the sizes differ otherwise, or nothing moves."""
    if [d for d in before if d != 1] != [d for d in after if d != 1]:
        return None
    parts, i, j = [], 0, 0
    while i < len(before) or j < len(after):
        if i < len(before) and j < len(after) and before[i] == after[j]:
            parts.append(":")
            i, j = i + 1, j + 1
        elif i < len(before) and before[i] == 1:
            parts.append("0")
            i += 1
        else:  # after[j] == 1: the sizes besides 1 are the same, in order
            parts.append("None")
            j += 1
    return None if all(p == ":" for p in parts) else ", ".join(parts)


class OpEmitter:
    def __init__(
        self,
        names: dict,
        literal_of,
        contiguous: set,
        place=None,
        kernel_call=None,
        workspace=None,
        workspace_elements=None,
    ):
        self.names = names
        self.literal_of = literal_of
        self.contiguous = contiguous  # values whose variable is a C-contiguous array
        self.place = place  # value -> Placement (codegen/render/placement.py)
        self.kernel_call = kernel_call  # (lines, scalars, bases) -> call of a shared kernel
        # node -> the arena slice its kernel works in (ir/kernel_workspace.py)
        self.workspace = workspace
        self.workspace_elements = workspace_elements  # node -> that slice's length
        # A strided view reshaped twice (attention's heads moved back beside the features, then
        # flattened for a bias sum and for a GEMM, or the same transpose recomputed) is copied
        # once: _view_chain of the view -> the variable holding the copy.
        self.copies: dict[tuple, str] = {}

    # ---- operands -----------------------------------------------------------------------------

    def array(self, value: Value, contiguous: bool = True) -> str:
        """Expression for value as an array of its internal shape."""
        lit = self.literal_of(alias_base(value))
        if lit is not None:
            shape = internal_shape(value.shape)
            return f"np.full({shape!r}, {lit}, {NP_TYPE[value.dtype]})"
        if is_alias(value):
            source = self.array(value.inputs[0], contiguous=False)
            shape = internal_shape(value.shape)
            if value.op == "broadcast_to":
                expr = f"np.broadcast_to({source}, {shape!r})"
                return f"np.ascontiguousarray({expr})" if contiguous else expr
            if value.op == "reshape":
                if self._contiguous_chain(value.inputs[0]):
                    return f"{source}.reshape({shape!r})"
                index = size_one_index(internal_shape(value.inputs[0].shape), shape)
                if index is not None and not contiguous:
                    return f"{source}[{index}]"
                return self.placed(value) or f"np.ascontiguousarray({source}).reshape({shape!r})"
            return source
        name = self.names[value]
        if contiguous and value not in self.contiguous:
            return self.placed(value) or f"np.ascontiguousarray({name})"
        return name

    def placed(self, value: Value) -> str | None:
        """value read where it lives when that is C-contiguous (a leading-axis slice of a
        buffer, size-1 axes moved or dropped): a 1-D slice of its base, reshaped, which NumPy
        and Numba both take as C order, so no copy is made. None when it is not contiguous
        there (or is a literal, or no placement is known): the caller copies then, and such a
        copy must be a planned buffer (ir/strided_copies.py)."""
        if self.place is None or self._view_chain(value)[0] is None:
            return None
        where = self.place(value)
        if not where.contiguous:
            return None
        end = where.offset + math.prod(where.shape)
        return f"{where.base}[{where.offset}:{end}].reshape({where.shape!r})"

    def _view_chain(self, value: Value) -> tuple:
        """(the variable of the array under value's views, the views): equal chains read the
        same data. The variable is None for a literal, which is never copied."""
        views = []
        while reads_its_input(value):
            views.append((value.op, repr(sorted(value.attrs.items())), value.shape))
            value = value.inputs[0]
        root = None if self.literal_of(value) is not None else self.names.get(value)
        return root, tuple(views)

    def _contiguous_chain(self, value: Value) -> bool:
        """value's array is C-contiguous: a buffer, or reshapes of one (not a broadcast)."""
        while value not in self.contiguous and is_alias(value) and value.op != "broadcast_to":
            value = value.inputs[0]
        return value in self.contiguous

    # ---- views --------------------------------------------------------------------------------

    def view(self, node: Value) -> list[str]:
        name, src = self.names[node], self.array(node.inputs[0], contiguous=False)
        if node.op == "reshape":
            contiguous = node.inputs[0] in self.contiguous
            shape = internal_shape(node.shape)
            index = size_one_index(internal_shape(node.inputs[0].shape), shape)
            if not contiguous and index is not None:  # strided still: readers copy if they must
                return [f"{name} = {src}[{index}]"]
            self.contiguous.add(node)
            if contiguous:
                return [f"{name} = {src}.reshape({shape!r})"]
            placed = self.placed(node)
            if placed is not None:
                return [f"{name} = {placed}"]
            chain = self._view_chain(node.inputs[0])
            copied = self.copies.get(chain)
            if copied is not None:  # values are immutable: the first copy holds the same data
                return [f"{name} = {copied}.reshape({shape!r})"]
            if chain[0] is not None:
                self.copies[chain] = name
            return [f"{name} = np.ascontiguousarray({src}).reshape({shape!r})"]
        if node.op == "transpose":
            if not node.shape:
                return [f"{name} = {src}"]
            perm = ",".join(str(p) for p in node.attrs["perm"])
            return [f'{name} = transposed({src}, "{perm}")']  # codegen/kernels/views.py
        slices = ", ".join(
            f"{a}:{'' if b < 0 else b}:{c}"
            for a, b, c in zip(
                node.attrs["starts"], node.attrs["stops"], node.attrs["steps"], strict=True
            )
        )
        return [f"{name} = {src}[{slices}]"]

    # ---- ops ----------------------------------------------------------------------------------

    def op(self, node: Value, out: str) -> list[str]:
        emitter = emitters().get(node.op)
        if emitter is None:
            raise Unsupported(f"no compiled form for {node.op}")
        return emitter(self, node, out)

    def index_error(self, node, indices: Value, what: str) -> list[str]:
        """`bad` is the flat position of the first bad index, or -1. The error carries the
        position, the value there and the indices' shape; the caller (CompiledPlan) names the
        user's line and fills them into `what` ("{value}", "{position}")."""
        flat = f"{self.array(indices)}.reshape(-1)"
        shape = tuple(indices.shape)
        return [
            "if bad != -1:",
            f"    raise IndexError({f'%{self.names[node][1:]} {node.op}: {what}'!r}, "
            f"bad, {flat}[bad], {shape!r})",
        ]

    @staticmethod
    def absorbs(value: Value) -> bool:
        """A transpose of the last two axes that matmul takes as a BLAS flag."""
        if value.op != "transpose" or len(value.shape) < 2:
            return False
        n = len(value.shape)
        return value.attrs["perm"] == tuple(range(n - 2)) + (n - 1, n - 2)

    def operand_2d(self, value: Value):
        """(array expression, transposed?) for a matmul operand; transposes become BLAS flags."""
        if self.absorbs(value):
            return self.array(value.inputs[0]), True
        return self.array(value), False

    @staticmethod
    def split(shape, axis: int, count: int = 1) -> tuple[int, int, int]:
        """The sizes before axis, of axis..axis+count, and after: the 3-D view kernels take."""
        return (
            math.prod(shape[:axis]),
            math.prod(shape[axis : axis + count]),
            math.prod(shape[axis + count :]),
        )

    def row_kernel(self, fn: str, rows: int, cols: int) -> str:
        """Library row kernels (exp, rsqrt per element) gain from threads at smaller sizes
        than fused loops; compiled once per installation, not per plan."""
        parallel = chosen(
            "parallel_rows", lambda: rows * cols >= (1 << 15) and rows > 1 and threads() > 1
        )
        return f"{fn}_par" if parallel else fn


# matmul's operands, read by its emitter (codegen/kernels/matmul.py) and by a GEMM epilogue's
# loop (codegen/render/emit.py); here so that rendering imports no BLAS.


def reads_16_bits(node: Value) -> bool:
    """Whether a matmul reads a bfloat16 or float16 operand (ir/widen.py leaves it so)."""
    return any(is_half(i.dtype) for i in node.inputs)


def reads_mixed(node: Value) -> bool:
    """Whether a matmul reads operands of two dtypes (ir/widen.py, ir/wide_reads.py), which
    only backplan's GEMM takes."""
    return len({i.dtype for i in node.inputs}) > 1


def own_gemm_chosen(ctx: OpEmitter, node: Value) -> bool:
    """Whether backplan's GEMM computes this matmul (else BLAS):
    codegen/kernels/gemm/choice.py. Always for bfloat16 and float16 operands (ir/widen.py
    leaves them unwidened for it, and a bfloat16 one beside a float32 one): BLAS has neither;
    and for a 2-D product reading an operand strided where it lives, which backplan's GEMM
    reads in place (ir/strided_copies.py reads_strided_operand: no copy in the arena)."""
    if reads_16_bits(node) or reads_mixed(node):
        return decide("own_gemm", True)
    if reads_strided_operand(node):  # read in place, no copy: BLAS takes unit strides only
        return decide("own_gemm", True)

    def own() -> bool:
        m, n = node.shape[-2:]
        k, tb = node.inputs[0].shape[-1], ctx.absorbs(node.inputs[1])
        ta = ctx.absorbs(node.inputs[0])
        return use_own_gemm(m, n, k, tb, node.dtype, trans_a=ta) or _parallel_parts(node) > 1

    return chosen("own_gemm", own)


def narrow_gemm_chosen(ctx: OpEmitter, node: Value) -> bool:
    """Whether a matmul not on backplan's blocked GEMM runs on its narrow one (else BLAS):
    gemm/choice.use_narrow_gemm."""
    m, n = node.shape[-2:]
    k, ta = node.inputs[0].shape[-1], ctx.absorbs(node.inputs[0])
    return chosen("narrow_gemm", lambda: use_narrow_gemm(m, n, k, ta, node.dtype))


def own_gemm_parts(node: Value) -> int:
    """Cores the own GEMM shares out (gemm/parallel.py): for a 16-bit matmul those a float32
    product would get from BLAS, which a 16-bit one cannot call; for a large float32 one
    those BLAS would have had (gemm/choice.own_parallel_parts); 1 for every other matmul."""
    if reads_16_bits(node):
        return chosen("own_gemm_parts", lambda: min(threads(), blas_threads()))
    return chosen("own_gemm_parts", lambda: _parallel_parts(node))


def _parallel_parts(node: Value) -> int:
    m, n = node.shape[-2:]
    return own_parallel_parts(m, n, node.inputs[0].shape[-1], node.dtype, threads())


def placed_operands(ctx: OpEmitter, node: Value, flat: bool = False):
    """[(transposed?, Placement)] of a 2-D matmul's operands, transposes taken as flags;
    None when one is a literal or not C-contiguous where it lives (a copy is made then).
    flat: bases seen as 1-D (what loop kernels take)."""
    operands = []
    for value in node.inputs:
        trans = ctx.absorbs(value)
        source = value.inputs[0] if trans else value
        if ctx.place is None or ctx.literal_of(alias_base(source)) is not None:
            return None
        where = ctx.place(source, flat=flat)
        if not where.contiguous:
            return None
        operands.append((trans, where))
    return operands


# The one table of ops codegen lowers as a kernel of their own: every registry op without a
# scalar expression, loop-tail reduction, view or source form (tests/test_registry.py checks
# that each op has exactly one lowering). Each kernel module of codegen/kernels registers its
# ops' emitters beside its kernels with @emits; generated modules import those modules' kernels.
OPAQUE_EMITTERS: dict = {}
_EMITTING_MODULES: set[str] = set()


def emits(*ops: str):
    """Register `fn(ctx: OpEmitter, node, out) -> lines` as the compiled form of ops."""

    def register(fn):
        for op in ops:
            if op in OPAQUE_EMITTERS:
                raise RuntimeError(f"two compiled forms for {op}: {fn.__module__}.{fn.__name__}")
            OPAQUE_EMITTERS[op] = fn
        _EMITTING_MODULES.add(fn.__module__)
        return fn

    return register


@functools.cache
def kernel_modules() -> tuple[str, ...]:
    """Every module of codegen/kernels imported (which registers their emitters); the names of
    those that registered one, whose kernels (their `__all__`) a generated plan's module
    imports."""
    from backplan.codegen import kernels

    for info in pkgutil.iter_modules(kernels.__path__):
        importlib.import_module(f"{kernels.__name__}.{info.name}")
    for name in _EMITTING_MODULES:
        if not hasattr(sys.modules[name], "__all__"):
            raise RuntimeError(f"{name} registers emitters but names no kernels in __all__")
    return tuple(sorted(name for name in _EMITTING_MODULES if sys.modules[name].__all__))


def emitters() -> dict:
    """op -> its emitter, once every kernel module has registered."""
    kernel_modules()
    return OPAQUE_EMITTERS


def unsupported_reason(lowered) -> str | None:
    """Why codegen cannot render this lowered plan (it then runs on the reference
    interpreter), or None: known before rendering, so reports need not render to ask."""
    table = emitters()
    kinds = lowered.op_kinds  # each op kernel's (op, dtype), in kernel order
    if kinds is None:
        kinds = [(k.nodes[0].op, k.nodes[0].dtype) for k in lowered.kernels if k.kind == "op"]
    for op, dtype in kinds:
        if op == "const":
            continue
        if op not in table:
            return f"no compiled form for {op}{_where(lowered, op, dtype)}"
        if op == "matmul" and dtype not in ("f32", "f64"):
            # 16-bit float matmuls are widened to float32 (ir/widen.py)
            return f"integer matmul{_where(lowered, op, dtype)}"
    return None


def _where(lowered, op: str, dtype: str) -> str:
    """' (matmul i64[2,3] at model.py:7)': the op's result and the user's line, so a warning
    about the whole plan says which line made it run on the interpreter; a node with no line
    (made by a pass) still names its op and type."""
    found = None
    for kernel in lowered.kernels:
        for node in kernel.all_nodes:
            if node.op == op and node.dtype == dtype:
                if node.loc is not None:
                    text = getattr(node.loc, "text", None)  # file and the functions it went through
                    return f" ({op} {node.type} at {text or os.path.basename(node.loc_text)})"
                found = found or node
    return "" if found is None else f" ({op} {found.type})"
