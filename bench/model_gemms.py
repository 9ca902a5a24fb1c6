"""Every GEMM shape of the bench models, with the GEMM each plan calls for it, read from explain.

bench/gemm.py's `--models mlp,transformer,...` times these shapes instead of its fixed list:
each model's value_and_grad step is explained at the thread count of the run, and every matmul
of its plan becomes a shape (a transpose the GEMM reads in place a flag), timed on the GEMM
explain names for it (backplan's blocked GEMM, on one core or several, its narrow GEMM, or BLAS
sgemm); a convolution's product (conv.py's im2col GEMM, on backplan's GEMM, row dots or BLAS
as conv_gemm_width picks) and the products of the fused attention kernel and its gradient (as
batched GEMMs over batch x heads: bench.attention times the fused kernel itself) are added.
The same shape used again in a model is timed once and its count shown.
"""

from __future__ import annotations

from dataclasses import dataclass

ATTENTION_OPS = ("attention", "attention_grad")
CONV_OPS = {"conv2d": (False, False), "conv2d_input_grad": (True, False),
            "conv2d_weight_grad": (False, True)}  # fmt: skip


@dataclass(frozen=True)
class GemmShape:
    """One product: op(A) (m x k) @ op(B) (k x n), `batch` of them (0: 2-D), on `path`."""

    batch: int
    m: int
    k: int
    n: int
    trans_a: bool
    trans_b: bool
    path: str  # "own", "own xN" (on N cores), "narrow", "row dots" or "blas"

    @property
    def shape(self) -> tuple:
        """bench/gemm.py's (batch, m, k, n, trans_a, trans_b)."""
        return (self.batch, self.m, self.k, self.n, self.trans_a, self.trans_b)

    def words(self) -> str:
        """'784x128^T@128x512': the operands as the GEMM reads them (^T: transposed in place)."""
        a = f"{self.k}x{self.m}^T" if self.trans_a else f"{self.m}x{self.k}"
        b = f"{self.n}x{self.k}^T" if self.trans_b else f"{self.k}x{self.n}"
        product = f"{a}@{b}"
        return f"{self.batch}x({product})" if self.batch else product


def path_of(gemm_words: str) -> str:
    """explain's words for the GEMM a matmul calls (codegen/render/gemm_names.py) -> a path."""
    if "narrow GEMM" in gemm_words:
        return "narrow"
    if gemm_words.startswith("backplan's"):
        cores = gemm_words.rsplit(" on ", 1)
        if len(cores) == 2 and cores[1].endswith(" cores"):
            return f"own x{int(cores[1].split()[0])}"
        return "own"
    if gemm_words.startswith("BLAS"):
        return "blas"
    raise ValueError(f"model_gemms: no GEMM path for explain's {gemm_words!r}")


def _transposed(value) -> bool:
    """Whether a matmul operand is a transpose of the last two axes (read in place as a flag)."""
    if value.op != "transpose":
        return False
    perm = tuple(value.attrs["perm"])
    rank = len(perm)
    return rank >= 2 and perm == (*range(rank - 2), rank - 1, rank - 2)


def matmul_shape(node, gemm_words: str) -> GemmShape:
    a, b = node.inputs
    ta, tb = _transposed(a), _transposed(b)
    m, n = node.shape[-2:]
    k = a.shape[-1]
    batch = 1
    for size in node.shape[:-2]:
        batch *= size
    return GemmShape(batch if len(node.shape) > 2 else 0, m, k, n, ta, tb, path_of(gemm_words))


def conv_shape(node) -> GemmShape:
    """The product conv.py's kernel for this node runs (one group: the bench CNN's)."""
    from .internals import ROW_DOTS, conv_gemm_width, conv_product_shape

    m, n, k = conv_product_shape(node, node.op)
    ta, tb = CONV_OPS[node.op]
    width = conv_gemm_width(m, n, k, node.dtype, trans_b=tb)
    path = {0: "blas", ROW_DOTS: "row dots"}.get(width, "own")
    return GemmShape(0, m, k, n, ta, tb, path)


def attention_path(node) -> str:
    """The GEMM the attention kernel runs its products on (attention.py's variant): the own
    GEMM, one product per thread ("own xN": the kernel runs (batch, head) pairs on N threads
    side by side), or BLAS where the shape's rule picks it (width 0)."""
    from .internals import attention_variant, threads

    name, width = attention_variant(node.op, node)
    if not width:
        return "blas"
    return f"own x{threads()}" if name.endswith("_par") else "own"


def attention_shapes(node) -> list[GemmShape]:
    """The products of attention over (batch, time, heads, dim) operands: Q K^T and P V
    forward; the gradient adds dS^T Q and P^T dO (and dO V^T, dS K: the forward's shapes)."""
    q = node.inputs[0]
    batch, t, heads, d = q.shape
    s = node.inputs[1].shape[1]
    bh = batch * heads
    path = attention_path(node)
    shapes = [
        GemmShape(bh, t, d, s, False, True, path),
        GemmShape(bh, t, s, d, False, False, path),
    ]
    if node.op == "attention_grad":
        shapes.append(GemmShape(bh, s, t, d, True, False, path))
    return shapes


def model_shapes(model: str) -> list[tuple[str, GemmShape]]:
    """[(what, shape)] for each product of the model's value_and_grad step, in plan order."""
    from .internals import use_backend
    from .models import value_and_grad_step

    step, args = value_and_grad_step(model)
    with use_backend("numba"):  # the compiled plan's GEMMs (the reference backend names none)
        report = step.explain(*args)
    steps, found = report.view.steps, []
    for kernel in report.kernels:
        for index in kernel.steps:
            node = steps[index].node
            if node.op == "matmul":
                found.append((f"matmul {steps[index].label}", matmul_shape(node, kernel.gemm)))
            elif node.op in CONV_OPS:
                found.append((f"{node.op} {steps[index].label}", conv_shape(node)))
            elif node.op in ATTENTION_OPS:
                label = f"{node.op} {steps[index].label}"
                found += [(label, shape) for shape in attention_shapes(node)]
    return found


def shapes_of(models: list[str]) -> dict[str, GemmShape]:
    """{row name: shape} over the models, each (shape, path) once per model, named
    'model op(A)@op(B) path' with ', N calls' where the model runs it N times."""
    rows: dict[str, GemmShape] = {}
    for model in models:
        counts: dict[GemmShape, int] = {}
        for _, shape in model_shapes(model):
            counts[shape] = counts.get(shape, 0) + 1
        for shape, count in counts.items():
            times = f", {count} calls" if count > 1 else ""
            rows[f"{model} {shape.words()} {shape.path}{times}"] = shape
    return rows
