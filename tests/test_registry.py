"""Every registry op, driven by the sample table in op_samples.py: reference against a NumPy
oracle, the shape/dtype rule against the reference, gradients against float64 central finite
differences (through the IR plans, eager calls and @compile), saved values, second derivatives."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
from op_samples import IN, OUT, SAMPLES, OpSample

import backplan as bp
from backplan.ir import all_ops, get_op
from backplan.ir.builder import Builder
from backplan.ir.graph import Graph
from backplan.ir.interpreter import evaluate, run_plan
from backplan.ir.pipeline import build_joint_plan, build_region_plans
from backplan.ir.registry import FUSION_CLASSES, AttrSpec
from backplan.ir.types import TensorType, dtype_name, is_float
from backplan.tracer.dispatch import apply

CASES = [pytest.param(s, dt, id=f"{s.id}-{dt}") for s in SAMPLES for dt in s.dtypes]
VALUE_TOL = {"f32": {"rtol": 2e-5, "atol": 2e-6}, "f64": {"rtol": 1e-10, "atol": 1e-12}}
SAME_TOL = {"f32": {"rtol": 1e-6, "atol": 1e-7}, "f64": {"rtol": 1e-12, "atol": 1e-14}}
FD_EPS = 1e-6
FD_RTOL = {"f32": 1e-4, "f64": 1e-6}  # relative to |grad| * |direction|
NO_EAGER_FORM = {"const"}  # const nodes exist only in graphs (trace constants, parsed text)


# ---- helpers ----------------------------------------------------------------------------------


def _rng(sample: OpSample, salt: int) -> np.random.Generator:
    return np.random.default_rng(7919 * sample.seed + salt)


def _as_f64(arrays):
    return [a.astype(np.float64) if a.dtype.kind == "f" else a for a in arrays]


def oracle_result(sample, dtype, arrays) -> np.ndarray:
    attrs = sample.resolved_attrs(dtype)
    if sample.constant is not None:
        return np.asarray(sample.oracle(sample.constants(dtype)["k0"], **attrs))
    return np.asarray(sample.oracle(*_as_f64(arrays), **attrs))


def reference_result(sample, dtype, arrays) -> np.ndarray:
    attrs = sample.resolved_attrs(dtype)
    if sample.op == "const":
        graph, _ = one_node_graph(sample, dtype)
        return evaluate(graph.outputs[0], [], graph.constants)
    return np.asarray(get_op(sample.op).reference(*arrays, **attrs))


def assert_values_close(actual, expected, tol=VALUE_TOL, what="", scale=1.0):
    actual = np.asarray(actual)
    if actual.dtype.kind != "f":
        np.testing.assert_array_equal(actual, np.asarray(expected).astype(actual.dtype), what)
        return
    t = tol[dtype_name(actual.dtype)]
    scale = max(scale, float(np.max(np.abs(expected), initial=0.0)))
    np.testing.assert_allclose(
        actual.astype(np.float64), expected, rtol=t["rtol"], atol=t["atol"] * scale, err_msg=what
    )


def one_node_graph(sample, dtype, with_loss: bool = False):
    """A graph holding one node of the op; with_loss adds a cotangent input c and returns
    sum(op(...) * c), the scalar a joint plan differentiates."""
    arrays = sample.inputs(dtype)
    graph = Graph(name=sample.op, constants=sample.constants(dtype))
    inputs = [graph.add_input(TensorType(dtype_name(a.dtype), a.shape)) for a in arrays]
    b = Builder(graph)
    node = b.emit(sample.op, *inputs, **sample.resolved_attrs(dtype))
    graph.outputs = [node]
    if with_loss:
        c = graph.add_input(node.type)
        graph.outputs = [b.sum(b.mul(node, c), axes=tuple(range(len(node.shape))))]
    return graph, arrays


def cotangent(sample, dtype, out) -> np.ndarray:
    return _rng(sample, 1).standard_normal(out.shape).astype(out.dtype)


def directions(sample, arrays, diff):
    rng = _rng(sample, 2)
    return {i: rng.standard_normal(arrays[i].shape) for i in diff}


def fd_projection(sample, dtype, arrays, cot, i, v) -> float:
    """(f(x + eps v) - f(x - eps v)) / 2 eps for f = <oracle(inputs), cot>, in float64."""
    base = _as_f64(arrays)
    attrs = {k: "f64" if v == "f32" else v for k, v in sample.resolved_attrs(dtype).items()}

    def f(xi):
        args = list(base)
        args[i] = xi
        out = sample.oracle(*args, **attrs)
        return float(np.sum(np.asarray(out, dtype=np.float64) * cot.astype(np.float64)))

    return (f(base[i] + FD_EPS * v) - f(base[i] - FD_EPS * v)) / (2 * FD_EPS)


def assert_grads_match_fd(sample, dtype, arrays, cot, grads: dict):
    for i, v in directions(sample, arrays, list(grads)).items():
        grad = grads[i].astype(np.float64)
        analytic = float(np.sum(grad * v))
        fd = fd_projection(sample, dtype, arrays, cot, i, v)
        bound = FD_RTOL[dtype] * (np.linalg.norm(grad) * np.linalg.norm(v) + 1e-3)
        assert abs(analytic - fd) <= bound, (
            f"{sample.id} {dtype} input {i}: <grad, v> = {analytic!r}, finite differences {fd!r}"
        )


def region_gradients(sample, dtype, wrt):
    """Forward plan, then backward plan fed with the saved slots, on the reference interpreter."""
    graph, arrays = one_node_graph(sample, dtype)
    plans = build_region_plans(graph, wrt)
    outputs = run_plan(plans.forward, list(arrays))
    out = outputs[0]
    if plans.backward is None:
        return out, None, {}
    saved = [
        arrays[i] if kind == "input" else outputs[i]
        for kind, i in (slot.source for slot in plans.saved)
    ]
    cot = [cotangent(sample, dtype, out)] if is_float(dtype_name(out.dtype)) else []
    grads = run_plan(plans.backward, cot + saved)
    diff = [i for i, w in enumerate(wrt) if w]
    return out, (cot[0] if cot else None), dict(zip(diff, grads, strict=True))


def joint_gradients(sample, dtype, wrt, cot):
    graph, arrays = one_node_graph(sample, dtype, with_loss=True)
    plan = build_joint_plan(graph, wrt + [False])
    loss, *grads = run_plan(plan, list(arrays) + [cot])
    diff = [i for i, w in enumerate(wrt) if w]
    return loss, dict(zip(diff, grads, strict=True))


def public_call(sample, dtype):
    attrs = sample.resolved_attrs(dtype)
    if sample.public is not None:
        return lambda *ts: sample.public(*ts, **attrs)
    return lambda *ts: apply(sample.op, list(ts), **attrs)


def api_gradients(sample, dtype, cot, compiled: bool):
    """Eager op call (or @bp.compile of it), then out.backward(cot)."""
    arrays = sample.inputs(dtype)
    diff = sample.float_inputs(dtype)
    tensors = [bp.tensor(a, requires_grad=i in diff) for i, a in enumerate(arrays)]
    call = public_call(sample, dtype)
    out = (bp.compile(call) if compiled else call)(*tensors)
    if out.requires_grad:
        out.backward(cot)
    grads = {
        i: np.zeros_like(arrays[i]) if tensors[i].grad is None else tensors[i].grad.numpy()
        for i in diff
    }
    return out, grads


def output_is_differentiable(sample, dtype) -> bool:
    graph, _ = one_node_graph(sample, dtype)
    opdef = get_op(sample.op)
    return (
        opdef.differentiable
        and is_float(graph.outputs[0].dtype)
        and bool(sample.float_inputs(dtype))
    )


# ---- the table covers the registry ------------------------------------------------------------


def test_every_registry_op_has_a_sample():
    missing = set(all_ops()) - {s.op for s in SAMPLES}
    assert not missing, f"ops without a sample in tests/op_samples.py: {sorted(missing)}"
    unknown = {s.op for s in SAMPLES} - set(all_ops())
    assert not unknown, f"samples name ops the registry lacks: {sorted(unknown)}"


@pytest.mark.parametrize("name", sorted(all_ops()))
def test_samples_cover_every_arity_and_float_dtype(name):
    opdef = get_op(name)
    samples = [s for s in SAMPLES if s.op == name]
    counts = {len(s.args) for s in samples}
    wanted = set(opdef.arity) if opdef.arity is not None else {1, 2}
    if opdef.arity is None:
        assert 1 in counts and max(counts) >= 2, f"{name}: sample one and several inputs"
    else:
        assert wanted <= counts, f"{name}: no sample with {sorted(wanted - counts)} inputs"
    assert any({"f32", "f64"} <= set(s.dtypes) for s in samples), f"{name}: no float sample"
    if opdef.differentiable and opdef.arity != (0,):
        assert any(s.saves is not None for s in samples), f"{name}: no sample states its saves"


@pytest.mark.parametrize("name", sorted(all_ops()))
def test_registry_entry_has_every_field(name):
    opdef = get_op(name)
    assert opdef.name == name
    assert opdef.arity is None or (
        isinstance(opdef.arity, tuple) and all(isinstance(n, int) and n >= 0 for n in opdef.arity)
    )
    assert callable(opdef.infer) and callable(opdef.reference)
    assert opdef.fusion in FUSION_CLASSES
    takes_inputs = opdef.arity is None or max(opdef.arity) > 0
    if opdef.differentiable and takes_inputs:
        assert callable(opdef.vjp), f"{name} is differentiable but has no derivative rule"
    if not opdef.differentiable:
        assert opdef.vjp is None, f"{name} is marked non-differentiable yet has a vjp"
    assert isinstance(opdef.doc, str) and opdef.doc.strip(), f"{name} has no doc"
    kinds = {"int", "float", "bool", "str", "dtype", "axes", "ints", "shape"}
    for key, spec in opdef.attrs.items():
        assert isinstance(spec, AttrSpec) and spec.kind in kinds, f"{name}.{key}"


@pytest.mark.parametrize("name", sorted(all_ops()))
def test_every_op_has_exactly_one_lowering(name):
    """Its scalar expression (fused loops), a loop-tail reduction, a view or source form, or
    an entry in codegen's one table of opaque kernels: never two, never none."""
    from backplan.codegen.render.opaque import emitters

    opaque = emitters()
    opdef = get_op(name)
    lowerings = {
        "scalar": opdef.scalar is not None,
        "loop_tail": opdef.loop_tail,
        "view": opdef.fusion == "view",
        "source": opdef.fusion == "source",
        "opaque kernel": name in opaque,
    }
    assert sum(lowerings.values()) == 1, f"{name}: lowerings {lowerings}"
    assert not opdef.alias or opdef.fusion == "view", f"{name}: only views are aliases"
    assert not opdef.epilogue or opdef.fusion == "opaque", f"{name}: an epilogue needs a kernel"
    assert set(opaque) <= set(all_ops()), "codegen lowers an op the registry lacks"


@pytest.mark.parametrize("name", sorted(n for n, op in all_ops().items() if op.scalar))
def test_scalar_templates_render_for_every_dtype_they_take(name):
    """Every placeholder of a template is one the renderer fills in."""
    from backplan.codegen.render.scalar import expression
    from backplan.ir.builder import Builder
    from backplan.ir.graph import Graph
    from backplan.ir.types import TensorType

    opdef = get_op(name)
    graph = Graph(name="t")
    inputs = [graph.add_input(TensorType("f32", (2,))) for _ in range(max(opdef.arity))]
    if name == "where":
        inputs[0] = graph.add_input(TensorType("bool", (2,)))
    attrs = {"dtype": "f64"} if name == "astype" else {}
    node = Builder(graph).emit(name, *inputs, **attrs)
    text = expression(node, [f"a{i}" for i in range(len(inputs))])
    assert "{" not in text and "a0" in text, text


# ---- forward: reference, oracle, shape rule ---------------------------------------------------


@pytest.mark.parametrize("sample,dtype", CASES)
def test_reference_matches_numpy_oracle(sample, dtype):
    arrays = sample.inputs(dtype)
    copies = [a.copy() for a in arrays]
    result = reference_result(sample, dtype, arrays)
    assert_values_close(result, oracle_result(sample, dtype, arrays), what=sample.id)
    for before, after in zip(copies, arrays, strict=True):
        np.testing.assert_array_equal(before, after, "the reference modified its input")


@pytest.mark.parametrize("sample,dtype", CASES)
def test_shape_rule_matches_reference(sample, dtype):
    opdef = get_op(sample.op)
    arrays = sample.inputs(dtype)
    opdef.check_arity(len(arrays))
    attrs = opdef.normalize_attrs(sample.resolved_attrs(dtype))
    inferred = opdef.infer([TensorType(dtype_name(a.dtype), a.shape) for a in arrays], attrs)
    result = reference_result(sample, dtype, arrays)
    assert inferred == TensorType(dtype_name(result.dtype), result.shape)


# ---- gradients --------------------------------------------------------------------------------


GRAD_CASES = [c for c in CASES if c.values[0].float_inputs(c.values[1])]


@pytest.mark.parametrize("sample,dtype", GRAD_CASES)
def test_ir_gradients_match_finite_differences(sample, dtype):
    diff = sample.float_inputs(dtype)
    wrt = [i in diff for i in range(len(sample.args))]
    out, cot, grads = region_gradients(sample, dtype, wrt)
    assert_values_close(out, oracle_result(sample, dtype, sample.inputs(dtype)))
    if not output_is_differentiable(sample, dtype):
        for g in grads.values():
            assert not np.any(g), f"{sample.op} passes no gradient, got {g}"
        return
    loss, joint = joint_gradients(sample, dtype, wrt, cot)
    terms = out.astype(np.float64) * cot
    assert_values_close(loss, np.sum(terms), scale=np.sum(np.abs(terms)))
    for i in diff:
        assert grads[i].dtype == sample.inputs(dtype)[i].dtype
        assert_values_close(joint[i], grads[i], SAME_TOL, f"joint vs region, input {i}")
    assert_grads_match_fd(sample, dtype, sample.inputs(dtype), cot, grads)


EAGER_CASES = [c for c in CASES if c.values[0].op not in NO_EAGER_FORM]


@pytest.mark.reference
@pytest.mark.parametrize("sample,dtype", EAGER_CASES)
def test_eager_and_compiled_gradients_agree_with_finite_differences(sample, dtype):
    arrays = sample.inputs(dtype)
    expected = oracle_result(sample, dtype, arrays)
    cot = cotangent(sample, dtype, reference_result(sample, dtype, arrays))
    eager_out, eager = api_gradients(sample, dtype, cot, compiled=False)
    compiled_out, compiled = api_gradients(sample, dtype, cot, compiled=True)
    assert_values_close(eager_out.numpy(), expected, what="eager")
    assert_values_close(compiled_out.numpy(), eager_out.numpy(), SAME_TOL, "compiled vs eager")
    differentiable = output_is_differentiable(sample, dtype)
    assert eager_out.requires_grad == differentiable
    assert compiled_out.requires_grad == differentiable
    if not differentiable:
        return
    for i in eager:
        assert_values_close(compiled[i], eager[i], SAME_TOL, f"compiled vs eager, input {i}")
    assert_grads_match_fd(sample, dtype, arrays, cot, eager)


# ---- saved values -----------------------------------------------------------------------------


def saved_sources(sample, wrt, dtype="f64") -> set[tuple[str, int]]:
    graph, _ = one_node_graph(sample, dtype)
    plans = build_region_plans(graph, wrt, remat=False)  # what the rule itself saves
    node = graph.outputs[0]
    for slot in plans.saved:
        kind, i = slot.source
        assert slot.reason.startswith(f"{sample.op} derivative reads")
        expected = graph.inputs[i] if kind == "input" else node
        if kind == "input":
            assert slot.forward is expected
        else:
            assert slot.forward.op == sample.op and slot.forward.type == node.type
    return {slot.source for slot in plans.saved}


SAVE_CASES = [
    pytest.param(s, id=s.id) for s in SAMPLES if s.saves is not None and "f64" in s.dtypes
]


@pytest.mark.parametrize("sample", SAVE_CASES)
def test_derivative_rule_saves_exactly_what_it_should(sample):
    diff = sample.float_inputs("f64")
    wrt = [i in diff for i in range(len(sample.args))]
    assert saved_sources(sample, wrt) == set(sample.saves)


def _sample(op: str, label: str = "") -> OpSample:
    return next(s for s in SAMPLES if s.op == op and s.label == label)


PARTIAL_SAVES = [
    ("mul", "", [True, False], {IN(1)}),
    ("mul", "", [False, True], {IN(0)}),
    ("matmul", "", [True, False], {IN(1)}),
    ("matmul", "", [False, True], {IN(0)}),
    ("div", "", [True, False], {IN(1)}),
    ("div", "", [False, True], {IN(1), OUT}),
    ("pow", "", [False, True], {IN(0), OUT}),
    ("where", "", [False, True, False], {IN(0)}),
    ("layer_norm", "affine", [True, False, False], {IN(0), IN(1)}),
    ("layer_norm", "affine", [False, True, False], {IN(0)}),
    ("layer_norm", "affine", [False, False, True], set()),
    ("concatenate", "", [False, True, False], set()),
]


@pytest.mark.parametrize(
    "op,label,wrt,expected", PARTIAL_SAVES, ids=[f"{p[0]}-{p[2]}" for p in PARTIAL_SAVES]
)
def test_saves_only_what_the_requested_gradients_need(op, label, wrt, expected):
    assert saved_sources(_sample(op, label), wrt) == expected


def test_layer_norm_saves_x_not_the_normalised_copy():
    sample = _sample("layer_norm", "affine")
    graph, _ = one_node_graph(sample, "f32")
    plans = build_region_plans(graph, [True, True, True])
    saved_bytes = sum(slot.forward.type.nbytes for slot in plans.saved)
    x, weight = graph.inputs[0].type, graph.inputs[1].type
    assert saved_bytes == x.nbytes + weight.nbytes
    assert all(slot.forward.op == "input" for slot in plans.saved)


# ---- ties, kinks and NaN: the behaviour the docs promise --------------------------------------


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_maximum_and_minimum_split_tied_gradients_evenly(compiled):
    """As torch.maximum / jax.numpy.maximum (and their minimum): the operand selected gets the
    gradient, a tie gives each half (before: all of it to x), including against a scalar
    (maximum(x, 0.0) at 0: 0.5, as both). NaN in x: neither, as JAX."""
    x = np.array([1.0, 2.0, 3.0, np.nan], np.float32)
    y = np.array([1.0, 0.0, 5.0, 1.0], np.float32)
    for fn, first in ((bp.maximum, [0.5, 1.0, 0.0, 0.0]), (bp.minimum, [0.5, 0.0, 1.0, 0.0])):

        def loss(a, b, fn=fn):
            return fn(a, b).sum() * 2.0

        grads = bp.grad(bp.compile(loss) if compiled else loss, argnums=(0, 1))
        gx, gy = grads(bp.tensor(x), bp.tensor(y))
        np.testing.assert_array_equal(gx.numpy(), 2 * np.array(first))
        np.testing.assert_array_equal(gy.numpy(), [1.0, 2 - 2 * first[1], 2 - 2 * first[2], 0.0])
    at_zero = bp.grad(lambda a: bp.maximum(a, 0.0).sum())(bp.tensor(np.zeros(2, np.float32)))
    np.testing.assert_array_equal(at_zero.numpy(), [0.5, 0.5])


def test_clip_keeps_the_whole_gradient_on_its_bounds():
    """bp.clip (torch.clamp's gradient): 1 inside and on either bound, 0 outside, NaN kept."""
    x = bp.tensor(np.array([-2.0, -1.0, 0.0, 1.0, 2.0, np.nan], np.float32), requires_grad=True)
    y = bp.clip(x, -1.0, 1.0)
    y.sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), [0.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    assert np.isnan(y.numpy()[-1])


def test_max_reduction_shares_the_gradient_between_ties():
    x = bp.tensor(np.array([[2.0, 2.0, 1.0], [0.0, 3.0, 3.0]]), requires_grad=True)
    bp.max(x, axis=1).backward(np.array([6.0, 4.0]))
    np.testing.assert_array_equal(x.grad.numpy(), [[3.0, 3.0, 0.0], [0.0, 2.0, 2.0]])


def test_relu_and_abs_have_zero_gradient_at_zero():
    for fn in (bp.relu, bp.abs):
        x = bp.tensor(np.zeros(3), requires_grad=True)
        fn(x).sum().backward()
        np.testing.assert_array_equal(x.grad.numpy(), np.zeros(3))


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: bp.maximum(x, 0.0),
        lambda x: bp.max(x, axis=0),
        bp.relu,
        lambda x: bp.minimum(x, 0.0),
    ],
    ids=["maximum", "max", "relu", "minimum"],
)
def test_nan_propagates_through_selecting_ops(fn):
    x = np.array([np.nan, 1.0, -1.0])
    assert np.isnan(fn(bp.tensor(x)).numpy().flat[0])


# ---- second derivatives -----------------------------------------------------------------------


SECOND_CASES = [
    pytest.param(s, id=s.id)
    for s in SAMPLES
    if "f64" in s.dtypes and s.op not in NO_EAGER_FORM and output_is_differentiable(s, "f64")
]


@pytest.mark.filterwarnings("ignore::backplan.Float64PromotionWarning")  # float64 meant here
@pytest.mark.parametrize("sample", SECOND_CASES)
def test_second_derivative_matches_finite_differences_of_the_gradient(sample):
    """h(x) = <grad f(x), D> with f(x) = <op(x), C>; bp.grad(h) against differences of h, which
    differentiates every derivative rule the op's backward uses."""
    arrays = sample.inputs("f64")
    diff = tuple(sample.float_inputs("f64"))
    call = public_call(sample, "f64")
    rng = _rng(sample, 3)
    c = bp.tensor(rng.standard_normal(oracle_result(sample, "f64", arrays).shape))
    d = {i: bp.tensor(rng.standard_normal(arrays[i].shape)) for i in diff}
    first = bp.grad(lambda *ts: bp.sum(call(*ts) * c), argnums=diff)

    def h(*ts):
        return functools.reduce(
            bp.add, [bp.sum(g * d[i]) for i, g in zip(diff, first(*ts), strict=True)]
        )

    second = bp.grad(h, argnums=diff)(*[bp.tensor(a) for a in arrays])
    for i, v in directions(sample, arrays, diff).items():

        def h_at(xi, i=i):
            args = [bp.tensor(xi if j == i else a) for j, a in enumerate(arrays)]
            return h(*args).item()

        fd = (h_at(arrays[i] + FD_EPS * v) - h_at(arrays[i] - FD_EPS * v)) / (2 * FD_EPS)
        grad = second[diff.index(i)].numpy()
        analytic = float(np.sum(grad * v))
        bound = 1e-5 * (np.linalg.norm(grad) * np.linalg.norm(v) + 1e-3)
        assert abs(analytic - fd) <= bound, f"input {i}: {analytic!r} vs {fd!r}"


@pytest.mark.parametrize(
    "fn,x",
    [
        (bp.tanh, 0.3),
        (bp.exp, -0.4),
        (bp.log, 1.7),
        (bp.sigmoid, 0.8),
        (bp.sqrt, 2.5),
        (bp.erf, 0.6),
        (bp.gelu, -0.7),
        (lambda x: x**3.5, 1.3),
        (lambda x: bp.pow(2.0, x), 0.9),
        (lambda x: 1.0 / x, 1.9),
    ],
    ids=["tanh", "exp", "log", "sigmoid", "sqrt", "erf", "gelu", "pow", "rpow", "reciprocal"],
)
def test_grad_of_grad_of_a_scalar_function(fn, x):
    second = bp.grad(bp.grad(fn))
    first = bp.grad(fn)
    at = np.float64(x)
    h = 1e-5
    fd = (first(bp.tensor(at + h)).item() - first(bp.tensor(at - h)).item()) / (2 * h)
    assert math.isclose(second(bp.tensor(at)).item(), fd, rel_tol=1e-7, abs_tol=1e-9)


# ---- dtype promotion of the public binary ops: NumPy 2, except across categories -------------

PROMOTION_TENSORS = {
    "bool": np.array([True, False]),
    "u8": np.array([1, 2], np.uint8),
    "i32": np.array([1, 2], np.int32),
    "i64": np.array([1, 2]),
    "f32": np.array([1.0, 2.0], np.float32),
    "f64": np.array([1.0, 2.0]),
}
PROMOTION_OTHERS = {
    **PROMOTION_TENSORS,
    "int": 3,
    "float": 2.5,
    "True": True,
    "np.float64": np.float64(2.5),
    "np.float32": np.float32(2.5),
    "np.int64": np.int64(3),
    "0-d f64": np.array(2.5),
}
PROMOTION_CASES = [
    pytest.param(op, a, b, swap, id=f"{op}-{a}-{b}{'-swapped' if swap else ''}")
    for op in ("mul", "sub", "div", "maximum")
    for a in PROMOTION_TENSORS
    for b in PROMOTION_OTHERS
    for swap in (False, True)
    if not (a == "bool" and b in ("bool", "True") and op != "div")  # bool arithmetic is refused
]


_CATEGORY = {"b": 0, "u": 1, "i": 1, "f": 2}


def expected_dtype(x, y, numpy_dtype):
    """NumPy 2's dtype, except that between two arrays (or NumPy scalars) of different
    categories the higher category's dtype wins, as in PyTorch and JAX: int64 * float32 is
    float32. Python scalars stay weak, as in NumPy 2."""
    strong = [np.asarray(v).dtype for v in (x, y) if isinstance(v, np.ndarray | np.generic)]
    if len(strong) == 2 and _CATEGORY[strong[0].kind] != _CATEGORY[strong[1].kind]:
        winner = max(strong, key=lambda d: _CATEGORY[d.kind])
        if winner.kind != "f" and numpy_dtype.kind == "f":
            return numpy_dtype  # true division of integers: float64, as NumPy
        return winner
    return numpy_dtype


@pytest.mark.filterwarnings("ignore::backplan.Float64PromotionWarning")  # float64 meant here
@pytest.mark.parametrize("op,a,b,swap", PROMOTION_CASES)
def test_binary_ops_promote_like_numpy2(op, a, b, swap):
    x, y = PROMOTION_TENSORS[a], PROMOTION_OTHERS[b]
    if swap:
        x, y = y, x
    numpy_fn = {"mul": np.multiply, "sub": np.subtract, "div": np.divide, "maximum": np.maximum}[op]
    wrap = [bp.tensor(v) if isinstance(v, np.ndarray) else v for v in (x, y)]
    with np.errstate(divide="ignore", invalid="ignore"):
        expected = numpy_fn(x, y)
        result = getattr(bp, op)(*wrap)
    assert result.dtype == expected_dtype(x, y, expected.dtype)
    np.testing.assert_allclose(result.numpy(), expected, rtol=1e-6)


def test_bool_arithmetic_is_refused_with_a_clear_error():
    with pytest.raises(bp.DtypeError, match="bool"):
        bp.mul(bp.tensor([True]), True)


@pytest.mark.parametrize(
    "op,types,attrs",
    [
        ("take_grad", [("f32", (3,)), ("i64", ())], {"axis": 5, "size": 2}),
        ("take_grad", [("f32", (3,)), ("i64", ())], {"axis": -1, "size": 2}),
        ("take_grad", [("f32", (3,)), ("i64", (3,))], {"axis": 0, "size": -2}),
        ("one_hot", [("i64", (2,))], {"depth": -3, "dtype": "f32"}),
        ("take", [("f32", (3,)), ("i64", (2,))], {"axis": 1}),
        ("slice", [("f32", (3,))], {"starts": (0,), "stops": (4,), "steps": (1,)}),
        ("reshape", [("f32", (3,))], {"shape": (2, 2)}),
    ],
    ids=[
        "take_grad-axis",
        "take_grad-negative-axis",
        "take_grad-size",
        "one_hot-depth",
        "take-axis",
        "slice-stop",
        "reshape-size",
    ],
)
def test_shape_rules_refuse_attributes_that_do_not_fit(op, types, attrs):
    opdef = get_op(op)
    with pytest.raises(bp.ShapeError):
        opdef.infer([TensorType(dt, shape) for dt, shape in types], opdef.normalize_attrs(attrs))
