"""The op registry: every op is defined once, with all the facts every pass and layer needs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .errors import BackplanError, ShapeError
from .types import DTYPES, TensorType

FUSION_CLASSES = ("elementwise", "reduction", "view", "opaque", "source")
# What recomputing an op costs. free: no arithmetic (sources, views); cheap: a few cycles per
# element, so a fused loop recomputes it rather than reading a stored copy; one_pass: one pass
# over a row (layer_norm), which backward recomputes rather than saving; costly: the rest
# (transcendentals, matmul, gathers), which are stored and read back.
COST_CLASSES = ("free", "cheap", "one_pass", "costly")
MAX_ELEMENTS = 2**40  # bigger tensors are refused: they cannot be real, and would hang numpy


@dataclass(frozen=True)
class AttrSpec:
    """How one attribute is checked: kind is int, float, bool, str, dtype, axes, ints or shape."""

    kind: str
    default: object = None
    choices: tuple = ()
    required: bool = True


@dataclass(frozen=True)
class OpDef:
    """One op. `vjp(ctx, g)` builds the derivative in registry ops; ctx.input/ctx.output record
    exactly which forward values it saves. `differentiable=False` ops pass no gradient.

    The lowering is plain data that fusion, remat and codegen read (ir itself never renders it):
    `scalar` is the expression a fused loop computes per element, a format string over the
    operands {0}, {1}, {2}, the output's {dtype} ("f32"), {np_type} ("np.float32"), {zero} (a
    literal 0 of the output dtype) and the op's attributes by name; a dict picks a template by
    output dtype, "*" for the rest. Elementwise ops without one, reductions that are not
    `loop_tail` and opaque ops are lowered by the emitter registered beside their kernel
    (`@emits("op")` in a module of codegen/kernels/). `alias` views are read through an index
    transform and cost nothing; `loop_tail` reductions accumulate in the loop computing their
    input. `epilogue` ops (a 2-D GEMM) run the loop that reads their result element for element
    on each block of it as they finish it (ir/epilogue.py)."""

    name: str
    arity: tuple[int, ...] | None  # allowed input counts; None means any number >= 1
    infer: Callable[[list[TensorType], dict], TensorType]
    reference: Callable[..., object]
    fusion: str
    vjp: Callable | None = None
    differentiable: bool = True
    attrs: dict[str, AttrSpec] = field(default_factory=dict)
    doc: str = ""
    scalar: str | dict[str, str] | None = None
    cost: str = "costly"
    alias: bool = False
    loop_tail: bool = False
    epilogue: bool = False
    # Arithmetic one run does, from the input and output types and the attributes; None: the
    # cost class's per-element estimate (ir/flops.py). Set where the work is not proportional
    # to the output.
    flops: Callable[[list[TensorType], TensorType, dict], int] | None = None

    def normalize_attrs(self, attrs: dict) -> dict:
        unknown = set(attrs) - set(self.attrs)
        if unknown:
            raise BackplanError(f"{self.name}: unknown attribute(s) {sorted(unknown)}")
        out = {}
        for key, spec in self.attrs.items():
            if key in attrs:
                out[key] = check_attr(self.name, key, spec, attrs[key])
            elif spec.default is None:  # optional without a default: absent unless given
                if spec.required:
                    raise BackplanError(f"{self.name}: missing attribute {key!r}")
            else:
                out[key] = spec.default
        return out

    def check_arity(self, n: int) -> None:
        if self.arity is None:
            if n < 1:
                raise ShapeError(f"{self.name} needs at least one input")
        elif n not in self.arity:
            raise ShapeError(
                f"{self.name} takes {' or '.join(map(str, self.arity))} inputs, got {n}"
            )


def check_attr(op: str, key: str, spec: AttrSpec, value):
    def bad(why: str):
        return BackplanError(f"{op}: attribute {key}={value!r} {why}")

    if value is None and not spec.required:
        return None
    kind = spec.kind
    if kind == "int":
        if not isinstance(value, int) or isinstance(value, bool) or abs(value) > MAX_ELEMENTS:
            raise bad("must be an integer of sensible size")
        return int(value)
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise bad("must be a number")
        return float(value) if isinstance(value, float) else value
    if kind == "bool":
        if not isinstance(value, bool):
            raise bad("must be True or False")
        return value
    if kind == "str":
        if not isinstance(value, str) or (spec.choices and value not in spec.choices):
            raise bad(f"must be one of {spec.choices}")
        return value
    if kind == "dtype":
        if value not in DTYPES:
            raise bad(f"must be one of {tuple(DTYPES)}")
        return value
    if kind in ("axes", "ints", "shape"):
        if not isinstance(value, tuple | list) or len(value) > 64:
            raise bad("must be a tuple of at most 64 integers")
        items = tuple(value)
        if any(not isinstance(v, int) or isinstance(v, bool) for v in items):
            raise bad("must hold integers only")
        if any(abs(v) > MAX_ELEMENTS for v in items):
            raise bad("holds an integer too large to be a size")
        if kind == "shape" and any(v < 0 for v in items):
            raise bad("must hold non-negative sizes")
        return items
    raise bad(f"has unknown kind {kind}")


REGISTRY: dict[str, OpDef] = {}  # filled by ir/ops/, which ir/__init__.py imports


def register(opdef: OpDef) -> OpDef:
    if opdef.name in REGISTRY:
        raise BackplanError(f"op {opdef.name!r} registered twice")
    if opdef.fusion not in FUSION_CLASSES:
        raise BackplanError(f"op {opdef.name!r}: unknown fusion class {opdef.fusion!r}")
    if opdef.cost not in COST_CLASSES:
        raise BackplanError(f"op {opdef.name!r}: unknown cost class {opdef.cost!r}")
    if opdef.scalar is not None and opdef.fusion != "elementwise":
        raise BackplanError(f"op {opdef.name!r}: only elementwise ops have a scalar expression")
    if opdef.epilogue and opdef.fusion != "opaque":
        raise BackplanError(f"op {opdef.name!r}: only opaque ops (a kernel each) run an epilogue")
    REGISTRY[opdef.name] = opdef
    return opdef


def get_op(name: str) -> OpDef:
    try:
        return REGISTRY[name]
    except KeyError:
        raise BackplanError(f"unknown op {name!r}") from None


def all_ops() -> dict[str, OpDef]:
    return dict(REGISTRY)
