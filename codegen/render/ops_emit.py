"""Source for the kernels that are one node each: views, matmul, gather/scatter, row composites.
Each emitter returns lines for the body of the plan's run function."""

from __future__ import annotations

import math

from backplan.codegen.flags import threads
from backplan.codegen.kernels.copies import (
    copy_kernel,
    fill_kernel,
    part_placement,
    slice_placement,
)
from backplan.codegen.kernels.gemm import vector_width
from backplan.codegen.kernels.gemm.choice import use_own_gemm
from backplan.codegen.render.loops import internal_shape
from backplan.codegen.render.scalar import NP_TYPE, literal
from backplan.ir.fusion import alias_base, is_alias
from backplan.ir.graph import Value
from backplan.ir.index_check import index_message, label_message
from backplan.ir.layout import reads_its_input

# Index errors are worded at codegen time with holes for what only the data knows.
HOLES = ("{value}", "{position}")


class Unsupported(Exception):
    """A pattern codegen does not compile; the plan then runs on the reference interpreter."""


class OpEmitter:
    def __init__(self, names: dict, literal_of, contiguous: set, place=None, kernel_call=None):
        self.names = names
        self.literal_of = literal_of
        self.contiguous = contiguous  # values whose variable is a C-contiguous array
        self.place = place  # value -> Placement (codegen/render/placement.py)
        self.kernel_call = kernel_call  # (lines, scalars, bases) -> call of a shared kernel
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
                return f"np.ascontiguousarray({source}).reshape({shape!r})"
            return source
        name = self.names[value]
        if contiguous and value not in self.contiguous:
            return f"np.ascontiguousarray({name})"
        return name

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
            self.contiguous.add(node)
            shape = internal_shape(node.shape)
            if contiguous:
                return [f"{name} = {src}.reshape({shape!r})"]
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
            perm = ", ".join(str(p) for p in node.attrs["perm"])
            return [f"{name} = {src}.transpose({perm})"]  # a tuple argument compiles 10x slower
        slices = ", ".join(
            f"{a}:{'' if b < 0 else b}:{c}"
            for a, b, c in zip(
                node.attrs["starts"], node.attrs["stops"], node.attrs["steps"], strict=True
            )
        )
        return [f"{name} = {src}[{slices}]"]

    # ---- ops ----------------------------------------------------------------------------------

    def op(self, node: Value, out: str) -> list[str]:
        emitter = OPAQUE_EMITTERS.get(node.op)
        if emitter is None:
            raise Unsupported(f"no compiled form for {node.op}")
        return emitter(self, node, out)

    def _raise(self, node, indices: Value, what: str) -> list[str]:
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

    def _operand_2d(self, value: Value):
        """(array expression, transposed?) for a matmul operand; transposes become BLAS flags."""
        if self.absorbs(value):
            return self.array(value.inputs[0]), True
        return self.array(value), False

    def own_gemm(self, node: Value) -> bool:
        """Whether backplan's GEMM computes this matmul (else BLAS):
        codegen/kernels/gemm/choice.py."""
        m, n = node.shape[-2:]
        k, tb = node.inputs[0].shape[-1], self.absorbs(node.inputs[1])
        return use_own_gemm(m, n, k, tb, node.dtype)

    def op_matmul(self, node: Value, out: str) -> list[str]:
        own = self.own_gemm(node)
        placed = self._placed_matmul(node, own) if len(node.shape) == 2 else None
        if placed is not None:
            return placed
        (a, ta), (b, tb) = self._operand_2d(node.inputs[0]), self._operand_2d(node.inputs[1])
        if len(node.shape) == 2:
            if own:
                return [f"own_gemm({vector_width()}, {ta}, {tb}, 1.0, {a}, {b}, 0.0, {out})"]
            return [f"gemm_{node.dtype}({ta}, {tb}, {a}, {b}, {out}, 0.0)"]
        return self._batched_matmul(node, out, (a, ta), (b, tb), own)

    def placed_operands(self, node, flat: bool = False):
        """[(transposed?, Placement)] of a 2-D matmul's operands, transposes taken as flags;
        None when one is a literal or not C-contiguous where it lives (a copy is made then).
        flat: bases seen as 1-D (what loop kernels take)."""
        operands = []
        for value in node.inputs:
            trans = self.absorbs(value)
            source = value.inputs[0] if trans else value
            if self.place is None or self.literal_of(alias_base(source)) is not None:
                return None
            where = self.place(source, flat=flat)
            if not where.contiguous:
                return None
            operands.append((trans, where))
        return operands

    def _placed_matmul(self, node, own: bool) -> list[str] | None:
        """A 2-D matmul whose operands are C-contiguous where they live: one library call
        taking bases and offsets; None when an operand is not (a copy is made then)."""
        operands = self.placed_operands(node)
        if operands is None:
            return None
        out = self.place(node, flat=False)
        (ta, a), (tb, b) = operands
        m, n = node.shape
        sizes = f"np.intp({m}), np.intp({n}), np.intp({node.inputs[0].shape[-1]})"
        places = ", ".join(f"{w.base}, np.intp({w.offset})" for w in (a, b, out))
        call = f"own_gemm_at({vector_width()}, " if own else f"gemm_at_{node.dtype}("
        return [f"{call}{ta}, {tb}, {sizes}, {places})"]

    def _batched_matmul(self, node, out, a_op, b_op, own: bool) -> list[str]:
        lines, operands = [], []
        batch = node.shape[:-2]
        for value, (expr, trans) in zip(node.inputs, (a_op, b_op), strict=True):
            source = value.inputs[0] if trans else value
            mat = source.shape[-2:]
            own_batch = source.shape[:-2]
            padded = (1,) * (len(batch) - len(own_batch)) + own_batch
            if math.prod(padded) not in (1, math.prod(batch)) or (
                math.prod(padded) != 1 and padded != batch
            ):
                expr = f"np.ascontiguousarray(np.broadcast_to({expr}, {batch + mat!r}))"
                padded = batch
            operands.append(f"{expr}.reshape(({math.prod(padded)}, {mat[0]}, {mat[1]}))")
        out3 = f"{out}.reshape(({math.prod(batch)}, {node.shape[-2]}, {node.shape[-1]}))"
        call = f"own_batched_gemm({vector_width()}, " if own else f"batched_gemm_{node.dtype}("
        lines.append(f"{call}{a_op[1]}, {b_op[1]}, {operands[0]}, {operands[1]}, {out3})")
        return lines

    def _split(self, shape, axis: int, count: int = 1):
        return (
            math.prod(shape[:axis]),
            math.prod(shape[axis : axis + count]),
            math.prod(shape[axis + count :]),
        )

    def op_take(self, node, out) -> list[str]:
        x, idx = node.inputs
        axis = node.attrs["axis"]
        pre, n, post = self._split(x.shape, axis)
        m = math.prod(idx.shape)
        return [
            f"bad = take_strided({self.array(x)}.reshape(({pre}, {n}, {post})), "
            f"{self.array(idx)}.reshape(({m},)), {out}.reshape(({pre}, {m}, {post})))",
            *self._raise(node, idx, index_message(*HOLES, n)),
        ]

    def op_take_grad(self, node, out) -> list[str]:
        g, idx = node.inputs
        axis, size = node.attrs["axis"], node.attrs["size"]
        m = math.prod(idx.shape)
        pre, post = math.prod(g.shape[:axis]), math.prod(g.shape[axis + len(idx.shape) :])
        return [
            f"bad = take_grad_strided({self.array(g)}.reshape(({pre}, {m}, {post})), "
            f"{self.array(idx)}.reshape(({m},)), {out}.reshape(({pre}, {size}, {post})))",
            *self._raise(node, idx, index_message(*HOLES, size)),
        ]

    def op_one_hot(self, node, out) -> list[str]:
        (labels,) = node.inputs
        rows, depth = math.prod(labels.shape), node.attrs["depth"]
        return [
            f"bad = one_hot({self.array(labels)}.reshape(({rows},)), "
            f"{out}.reshape(({rows}, {depth})))",
            *self._raise(node, labels, label_message(*HOLES, depth)),
        ]

    def op_pad_slice(self, node, out) -> list[str]:
        value = node.inputs[0]
        if self.kernel_call is not None and node.shape:
            where = self.place(node)
            target = slice_placement(node, where, internal_shape(value.shape))
            source = self.literal_of(alias_base(value)) or self.place(value)
            fill = self.kernel_call(*fill_kernel(where))
            return [fill, self.kernel_call(*copy_kernel(target, source, node.dtype))]
        slices = ", ".join(
            f"{a}:{'' if b < 0 else b}:{c}"
            for a, b, c in zip(
                node.attrs["starts"], node.attrs["stops"], node.attrs["steps"], strict=True
            )
        )
        return [f"{out}[:] = 0", f"{out}[{slices}] = {self.array(node.inputs[0], False)}"]

    def op_concatenate(self, node, out) -> list[str]:
        """Each part copied into its slice of the output: no temporary."""
        axis, lines, offset = node.attrs["axis"], [], 0
        if self.kernel_call is not None:
            where = self.place(node)
            for value in node.inputs:
                target = part_placement(where, axis, offset, internal_shape(value.shape))
                source = self.literal_of(alias_base(value)) or self.place(value)
                lines.append(self.kernel_call(*copy_kernel(target, source, node.dtype)))
                offset += value.shape[axis]
            return lines
        for value in node.inputs:
            size = value.shape[axis]
            index = ", ".join([":"] * axis + [f"{offset}:{offset + size}"])
            lines.append(f"{out}[{index}] = {self.array(value, contiguous=False)}")
            offset += size
        return lines

    def _rows(self, fn: str, rows: int, cols: int) -> str:
        """Library row kernels (exp, rsqrt per element) gain from threads at smaller sizes
        than fused loops; compiled once per installation, not per plan."""
        parallel = rows * cols >= (1 << 15) and rows > 1 and threads() > 1
        return f"{fn}_par" if parallel else fn

    def _softmax(self, node, out, log: bool) -> list[str]:
        (x,) = node.inputs
        pre, n, post = self._split(x.shape, node.attrs["axis"])
        if post == 1:
            fn = self._rows("softmax_rows", pre, n)
            return [
                f"{fn}({self.array(x)}.reshape(({pre}, {n})), {out}.reshape(({pre}, {n})), {log})"
            ]
        return [
            f"softmax_strided({self.array(x)}.reshape(({pre}, {n}, {post})), "
            f"{out}.reshape(({pre}, {n}, {post})), {log})"
        ]

    def op_softmax(self, node, out) -> list[str]:
        return self._softmax(node, out, False)

    def op_log_softmax(self, node, out) -> list[str]:
        return self._softmax(node, out, True)

    def op_logsumexp(self, node, out) -> list[str]:
        (x,) = node.inputs
        axes = node.attrs["axes"]
        if not axes:
            return [f"{out}[:] = {self.array(x)}"]
        source = self.array(x)
        if list(axes) != list(range(axes[0], axes[-1] + 1)):
            kept = [a for a in range(len(x.shape)) if a not in axes]
            perm = ", ".join(str(a) for a in kept + list(axes))
            source = f"np.ascontiguousarray({source}.transpose({perm}))"
            pre, n, post = (
                math.prod(x.shape[a] for a in kept),
                math.prod(x.shape[a] for a in axes),
                1,
            )
        else:
            pre, n, post = self._split(x.shape, axes[0], len(axes))
        return [
            f"logsumexp_strided({source}.reshape(({pre}, {n}, {post})), "
            f"{out}.reshape(({pre}, {post})))"
        ]

    def op_layer_norm(self, node, out) -> list[str]:
        x = node.inputs[0]
        cols = x.shape[-1]
        rows = math.prod(x.shape[:-1])
        affine = len(node.inputs) == 3
        w = self.array(node.inputs[1]) if affine else f"np.empty(1, {NP_TYPE[x.dtype]})"
        b = self.array(node.inputs[2]) if affine else w
        fn = self._rows("layer_norm_rows", rows, cols)
        return [
            f"{fn}({self.array(x)}.reshape(({rows}, {cols})), {w}, {b}, {affine}, "
            f"{literal(node.attrs['eps'], x.dtype)}, {out}.reshape(({rows}, {cols})))"
        ]

    def op_cross_entropy(self, node, out) -> list[str]:
        logits, labels = node.inputs
        cols = logits.shape[-1]
        rows = math.prod(logits.shape[:-1])
        reduction = node.attrs["reduction"]
        scale = 1.0
        if reduction == "mean":
            scale = 1.0 / rows if rows else math.nan  # the mean over no rows is nan, as NumPy's
        target = f"{out}.reshape(({rows},))" if reduction == "none" else out
        if reduction == "sum" and rows == 1:
            scale = 1.0  # one row: the per-row loss is the sum
        return [
            f"bad = cross_entropy_rows({self.array(logits)}.reshape(({rows}, {cols})), "
            f"{self.array(labels)}.reshape(({rows},)), {target}, {literal(scale, 'f64')})",
            *self._raise(node, labels, label_message(*HOLES, cols)),
        ]

    # ---- random draws, convolutions, arg-extremes -----------------------------------------------

    def _key_check(self, node, key: str) -> list[str]:
        return [
            f"bad = check_key({key})",
            *self._raise(
                node,
                node.inputs[0],
                "key word {value} at position {position} must lie in [0, 2**32); "
                "make keys with bp.random.key",
            ),
        ]

    def _draw(self, node, out, fn: str, extra: str = "") -> list[str]:
        key = self.array(node.inputs[0])
        size = math.prod(node.shape)
        variant = "par" if size >= (1 << 16) else "serial"
        return [
            *self._key_check(node, key),
            f"{fn}_{variant}({key}, {out}.reshape(({size},)){extra})",
        ]

    def op_random_uniform(self, node, out) -> list[str]:
        return self._draw(node, out, "random_uniform", f", {node.dtype == 'f64'}")

    def op_random_normal(self, node, out) -> list[str]:
        return self._draw(node, out, "random_normal")

    def op_random_split(self, node, out) -> list[str]:
        key = self.array(node.inputs[0])
        return [*self._key_check(node, key), f"random_split({key}, {out})"]

    def _conv(self, node, out, fn: str) -> list[str]:
        a, b = (self.array(v) for v in node.inputs)
        (sh, sw), (ph, pw) = node.attrs["stride"], node.attrs["padding"]
        dh, dw = node.attrs["dilation"]
        args = f"{sh}, {sw}, {ph}, {pw}, {dh}, {dw}, {node.attrs['groups']}"
        return [f"{fn}_gemm({a}, {b}, {out}, {args})"]

    def op_conv2d(self, node, out) -> list[str]:
        return self._conv(node, out, "conv2d")

    def op_conv2d_input_grad(self, node, out) -> list[str]:
        return self._conv(node, out, "conv2d_input_grad")

    def op_conv2d_weight_grad(self, node, out) -> list[str]:
        return self._conv(node, out, "conv2d_weight_grad")

    # ---- fused attention (codegen/kernels/attention.py) ----------------------------------------

    def _heads(self, value: Value) -> str:
        """value as a 4-D (batch, heads, length, features) array: a strided view passes as it
        is when there are exactly two leading axes; otherwise a contiguous reshape."""
        lead = value.shape[:-2]
        if len(lead) == 2:
            return self.array(value, contiguous=False)
        return f"{self.array(value)}.reshape({self._heads_shape(lead, value.shape[-2:])!r})"

    def _attention_variant(self, fn: str, node: Value) -> tuple[str, int]:
        """The kernel (parallel over (batch, head) pairs when that pays) and its GEMM width:
        the own GEMM's in parallel (single-threaded, lock-free), else as chosen per shape,
        0 meaning BLAS (codegen/kernels/attention.py)."""
        q, k = node.inputs[0], node.inputs[1]
        pairs = math.prod(q.shape[:-2])
        t, s, d = q.shape[-2], k.shape[-2], q.shape[-1]
        parallel = threads() > 1 and pairs > 1 and pairs * t * s * max(d, 1) >= (1 << 16)
        if parallel:
            return f"{fn}_par", vector_width()
        own = use_own_gemm(min(t, 128), s, d, True, node.dtype)
        return fn, vector_width() if own else 0

    def _attention_args(self, node: Value) -> str:
        return f"{node.attrs['scale']!r}, {node.attrs['causal']}"

    def op_attention(self, node, out) -> list[str]:
        q, k, v = (self._heads(x) for x in node.inputs)
        lead = node.inputs[0].shape[:-2]
        out4 = f"{out}.reshape({self._heads_shape(lead, node.shape[-2:])!r})"
        fn, width = self._attention_variant("attention_forward", node)
        return [f"{fn}({width}, {q}, {k}, {v}, {out4}, {self._attention_args(node)})"]

    def op_attention_grad(self, node, out) -> list[str]:
        q, k, v, g = (self._heads(x) for x in node.inputs)
        lead, parts, offset = node.inputs[0].shape[:-2], [], 0
        for x in node.inputs[:3]:
            shape = self._heads_shape(lead, x.shape[-2:])
            parts.append(f"{out}[{offset}:{offset + x.type.size}].reshape({shape!r})")
            offset += x.type.size
        fn, width = self._attention_variant("attention_backward", node)
        return [
            f"{fn}({width}, {q}, {k}, {v}, {g}, {', '.join(parts)}, {self._attention_args(node)})"
        ]

    @staticmethod
    def _heads_shape(lead, tail) -> tuple:
        if len(lead) <= 2:
            return (1,) * (2 - len(lead)) + tuple(lead) + tuple(tail)
        return (math.prod(lead[:-1]), lead[-1]) + tuple(tail)

    def _arg_extreme(self, node, out, want_max: bool) -> list[str]:
        (x,) = node.inputs
        pre, n, post = self._split(x.shape, node.attrs["axis"])
        return [
            f"arg_extreme_strided({self.array(x)}.reshape(({pre}, {n}, {post})), "
            f"{out}.reshape(({pre}, {post})), {want_max})"
        ]

    def op_argmax(self, node, out) -> list[str]:
        return self._arg_extreme(node, out, True)

    def op_argmin(self, node, out) -> list[str]:
        return self._arg_extreme(node, out, False)


# The one table of ops codegen lowers as a kernel of their own: every registry op without a
# scalar expression, loop-tail reduction, view or source form (tests/test_registry.py checks
# that each op has exactly one lowering).
OPAQUE_EMITTERS = {
    "matmul": OpEmitter.op_matmul,
    "take": OpEmitter.op_take,
    "take_grad": OpEmitter.op_take_grad,
    "one_hot": OpEmitter.op_one_hot,
    "pad_slice": OpEmitter.op_pad_slice,
    "concatenate": OpEmitter.op_concatenate,
    "softmax": OpEmitter.op_softmax,
    "log_softmax": OpEmitter.op_log_softmax,
    "logsumexp": OpEmitter.op_logsumexp,
    "layer_norm": OpEmitter.op_layer_norm,
    "cross_entropy": OpEmitter.op_cross_entropy,
    "random_uniform": OpEmitter.op_random_uniform,
    "random_normal": OpEmitter.op_random_normal,
    "random_split": OpEmitter.op_random_split,
    "conv2d": OpEmitter.op_conv2d,
    "conv2d_input_grad": OpEmitter.op_conv2d_input_grad,
    "conv2d_weight_grad": OpEmitter.op_conv2d_weight_grad,
    "attention": OpEmitter.op_attention,
    "attention_grad": OpEmitter.op_attention_grad,
    "argmax": OpEmitter.op_argmax,
    "argmin": OpEmitter.op_argmin,
}


def unsupported_reason(lowered) -> str | None:
    """Why codegen cannot render this lowered plan (it then runs on the reference
    interpreter), or None: known before rendering, so reports need not render to ask."""
    for kernel in lowered.kernels:
        if kernel.kind != "op":
            continue
        node = kernel.nodes[0]
        if node.op == "const":
            continue
        if node.op not in OPAQUE_EMITTERS:
            return f"no compiled form for {node.op}"
        if node.op == "matmul" and node.dtype not in ("f32", "f64"):
            return "integer matmul"
    return None
