"""The text form: printing then parsing gives back the same graph and frees, for forward,
backward and joint plans; malformed text raises ParseError and is never evaluated."""

from __future__ import annotations

import math

import numpy as np
import pytest

import backplan as bp
from backplan.ir import ParseError, VerifyError
from backplan.ir.builder import Builder
from backplan.ir.graph import Graph
from backplan.ir.interpreter import run_plan
from backplan.ir.liveness import Plan, plan_liveness
from backplan.ir.text import format_attr, format_graph, parse_graph
from backplan.ir.types import TensorType
from backplan.ir.verify import verify_graph

RNG = np.random.default_rng(11)


# ---- programs whose plans are printed ---------------------------------------------------------


def mlp_loss(w, b, x, labels):
    hidden = bp.gelu(x @ w + b, approximate="tanh")
    return bp.cross_entropy(hidden, labels, reduction="mean")


def attribute_zoo(x, w, idx):
    """Negative numbers, inf and nan fills, tuples, strings, negative slice steps, gathers."""
    y = bp.maximum(x, -2.5)
    y = bp.where(x > 100.0, float("nan"), y)
    y = bp.where(x < -100.0, float("-inf"), y)
    y = bp.concatenate([y[::-1, 1:], bp.transpose(y[:, :1], (0, 1))], axis=1)
    z = bp.layer_norm(y @ w, eps=1e-5) + bp.logsumexp(y, axis=1, keepdims=True)
    z = bp.softmax(z.reshape(2, 3, 2), axis=0)[idx]
    return (z * float("inf")).sum() * 0.0 + bp.var(z, axis=(0, 2)).sum()


def mlp_args():
    return (
        bp.tensor(RNG.standard_normal((3, 4)), requires_grad=True),
        bp.tensor(RNG.standard_normal(4), requires_grad=True),
        bp.tensor(RNG.standard_normal((5, 3))),
        bp.tensor(np.array([0, 3, 1, 1, 2])),
    )


def zoo_args():
    return (
        bp.tensor(RNG.standard_normal((4, 3)), requires_grad=True),
        bp.tensor(RNG.standard_normal((3, 3)), requires_grad=True),
        bp.tensor(np.array([1, -1, 0])),
    )


def constant_graph() -> tuple[Graph, dict]:
    """A graph with a const node (only graphs and parsed text hold them)."""
    constants = {"k0": RNG.standard_normal((2, 3)).astype(np.float32)}
    graph = Graph(name="with_const", constants=dict(constants))
    x = graph.add_input(TensorType("f32", (2, 3)))
    b = Builder(graph, loc=("model.py", 7))
    k = b.emit("const", name="k0", shape=(2, 3), dtype="f32")
    graph.outputs = [b.mul(b.add(x, k), b.scalar(-0.5, "f32"))]
    return graph, constants


def eager_layer_norm():
    """An eager one-op region keeps layer_norm whole (compiled plans expand it)."""
    x = bp.tensor(RNG.standard_normal((3, 5)).astype(np.float32), requires_grad=True)
    return bp.layer_norm(x, eps=1e-5).grad_fn.program.plans


def region_plans(fn, args):
    return bp.compile(fn).trace(*args).program.plans


PLANS = {
    "mlp-forward": lambda: region_plans(mlp_loss, mlp_args()).forward,
    "mlp-backward": lambda: region_plans(mlp_loss, mlp_args()).backward,
    "mlp-joint": lambda: bp.value_and_grad(mlp_loss, argnums=(0, 1)).trace(*mlp_args()).plan,
    "zoo-forward": lambda: region_plans(attribute_zoo, zoo_args()).forward,
    "zoo-backward": lambda: region_plans(attribute_zoo, zoo_args()).backward,
    "zoo-joint": lambda: bp.value_and_grad(attribute_zoo, argnums=(0, 1)).trace(*zoo_args()).plan,
    "const": lambda: plan_liveness(constant_graph()[0]),
    "eager-layer_norm": lambda: eager_layer_norm().forward,
}


# ---- round trips ------------------------------------------------------------------------------


def same_attr(a, b) -> bool:
    """Equal values of equal types; nan equals nan."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(same_attr(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def positions(graph: Graph) -> dict:
    return {v: i for i, v in enumerate(graph.inputs + graph.nodes)}


def assert_same_structure(a: Graph, b: Graph):
    pa, pb = positions(a), positions(b)
    assert a.name == b.name
    assert [(v.type, v.role) for v in a.inputs] == [(v.type, v.role) for v in b.inputs]
    for na, nb in zip(a.nodes, b.nodes, strict=True):
        assert (na.op, na.type, na.loc and na.loc[1]) == (nb.op, nb.type, nb.loc and nb.loc[1])
        assert [pa[i] for i in na.inputs] == [pb[i] for i in nb.inputs]
        assert na.attrs.keys() == nb.attrs.keys()
        for key in na.attrs:
            assert same_attr(na.attrs[key], nb.attrs[key]), (na.op, key)
    assert [pa[o] for o in a.outputs] == [pb[o] for o in b.outputs]


def free_positions(graph, frees) -> dict[int, list[int]]:
    where = positions(graph)
    return {step: [where[v] for v in values] for step, values in frees.items() if values}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_round_trip_is_exact(name):
    plan = PLANS[name]()
    text = plan.text()
    graph, frees = parse_graph(text, plan.graph.constants)
    assert format_graph(graph, frees) == text
    assert_same_structure(plan.graph, graph)
    assert free_positions(graph, frees) == free_positions(plan.graph, plan.frees_after)
    assert free_positions(graph, plan_liveness(graph).frees_after) == free_positions(graph, frees)


@pytest.mark.parametrize("name", sorted(PLANS))
def test_parsed_plan_computes_the_same_values(name):
    plan = PLANS[name]()
    graph, frees = parse_graph(plan.text(), plan.graph.constants)
    parsed = Plan(graph, frees_after=frees)
    args = [input_array(v.type) for v in plan.graph.inputs]
    expected = run_plan(plan, list(args))
    actual = run_plan(parsed, list(args))
    for e, a in zip(expected, actual, strict=True):
        assert e.dtype == a.dtype
        np.testing.assert_array_equal(e, a)


def input_array(type_: TensorType) -> np.ndarray:
    if type_.dtype == "i64":
        return np.zeros(type_.shape, dtype=np.int64)  # indices and labels: always in range
    if type_.dtype == "bool":
        return np.ones(type_.shape, dtype=bool)
    dtype = np.float32 if type_.dtype == "f32" else np.float64
    return RNG.standard_normal(type_.shape).astype(dtype)


def test_the_printed_plans_show_what_the_round_trip_covers():
    """Guards the programs above: their text really holds the features the round trip is for."""
    texts = "\n".join(PLANS[name]().text() for name in PLANS)
    for feature in (
        "value=-2.5",
        "value=nan",
        "value=-inf",
        "value=inf",
        "approximate='tanh'",
        "reduction='mean'",
        "steps=(-1, 1)",
        "stops=(-1, 3)",
        "perm=(",
        "axes=(0, 2)",
        "const {name='k0'",
        "free %",
        " saved",
        " cotangent",
        "eps=1e-05",
        "# model.py:7",
        "# test_text_form.py:",
    ):
        assert feature in texts, feature


@pytest.mark.parametrize(
    "value,text",
    [
        (math.inf, "inf"),
        (-math.inf, "-inf"),
        (-2.5, "-2.5"),
        (1e-05, "1e-05"),
        ((0,), "(0,)"),
        ((1, -2), "(1, -2)"),
        ("tanh", "'tanh'"),
        (True, "True"),
        (None, "None"),
    ],
)
def test_attribute_values_print_as_literals(value, text):
    assert format_attr(value) == text


# ---- malformed text ---------------------------------------------------------------------------

GOOD = """graph @f(%0: f32[2,3] arg, %1: f32[3] arg) {
  %2 = add %0, %1 : f32[2,3]  # model.py:3
  %3 = sum %2 {axes=(0, 1), keepdims=False} : f32[]  # model.py:4
  free %2
  return %3
}"""


def test_the_good_text_parses():
    graph, frees = parse_graph(GOOD)
    assert [n.op for n in graph.nodes] == ["add", "sum"]
    assert format_graph(graph, frees) == GOOD


BAD = {
    "unknown op": ("%2 = add %0, %1", "%2 = frobnicate %0, %1"),
    "bad dtype": ("%0: f32[2,3] arg", "%0: f33[2,3] arg"),
    "bad dims": ("%1: f32[3] arg", "%1: f32[x] arg"),
    "absurd size": ("%1: f32[3] arg", "%1: f32[99999999999999999999] arg"),
    "bad role": ("%1: f32[3] arg", "%1: f32[3] argument"),
    "use before definition": ("add %0, %1", "add %0, %4"),
    "free before definition": ("free %2", "free %9"),
    "type mismatch": (
        "%3 = sum %2 {axes=(0, 1), keepdims=False} : f32[]",
        "%3 = sum %2 {axes=(0, 1), keepdims=False} : f32[2]",
    ),
    "dtype mismatch": (": f32[2,3]  # model.py:3", ": f64[2,3]  # model.py:3"),
    "wrong arity": ("add %0, %1", "add %0"),
    "bad attribute value": ("keepdims=False", "keepdims=0"),
    "unknown attribute": ("keepdims=False", "keepdims=False, colour='red'"),
    "attribute twice": ("keepdims=False", "keepdims=False, keepdims=True"),
    "positional attribute": ("axes=(0, 1), keepdims=False", "(0, 1), False"),
    "defined twice": ("%3 = sum", "%2 = sum"),
    "no return": ("  return %3\n", ""),
    "node after return": ("  free %2\n  return %3\n", "  return %3\n  %4 = neg %3 : f32[]\n"),
    "bad header": ("graph @f(", "graph f("),
    "junk after type": (": f32[]  # model.py:4", ": f32[] junk"),
    "missing constant": (
        "%2 = add %0, %1 : f32[2,3]",
        "%2 = const {name='k9', shape=(2, 3), dtype='f32'} : f32[2,3]",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_malformed_text_raises_parse_error(case):
    old, new = BAD[case]
    assert old in GOOD
    with pytest.raises(ParseError):
        parse_graph(GOOD.replace(old, new, 1))


NOT_LITERALS = [
    "__import__('os').system('touch {marker}')",
    "open('{marker}', 'w')",
    'exec(\'open("{marker}", "w")\')',
    "[open('{marker}', 'w') for _ in (1,)]",
    "(lambda: open('{marker}', 'w'))()",
    'f\'{{open("{marker}", "w")}}\'',
    "1 + 1",
    "b'bytes'",
    "1j",
    "...",
    "{{'a': 1}}",
    "+1",
    "os.sep",
]


@pytest.mark.parametrize("expression", NOT_LITERALS)
def test_attribute_that_is_not_a_literal_is_refused_unevaluated(expression, tmp_path):
    marker = tmp_path / "evaluated"
    attr = expression.format(marker=marker)
    text = GOOD.replace("keepdims=False", f"keepdims={attr}")
    with pytest.raises(ParseError, match="not a literal|bad attributes"):
        parse_graph(text)
    assert not marker.exists()


def test_deeply_nested_attribute_is_a_parse_error():
    text = GOOD.replace("axes=(0, 1)", "axes=" + "(" * 500 + "0" + ")" * 500)
    with pytest.raises(ParseError):
        parse_graph(text)


def test_parse_errors_name_the_line():
    with pytest.raises(ParseError, match="line 3"):
        parse_graph(GOOD.replace("%3 = sum %2", "%3 = max %9"))


@pytest.mark.parametrize(
    "array",
    [np.array([1, 2]), [1.0, 2.0], np.zeros(3, np.float32)],
    ids=["wrong dtype", "not an array", "wrong shape"],
)
def test_loaded_constants_must_match_their_const_node(array):
    text = """graph @f(%0: f32[2] arg) {
  %1 = const {name='k0', shape=(2,), dtype='f32'} : f32[2]
  %2 = add %0, %1 : f32[2]
  return %2
}"""
    graph, _ = parse_graph(text, {"k0": array})
    with pytest.raises(VerifyError, match="constant"):
        verify_graph(graph)
    graph, _ = parse_graph(text, {"k0": np.zeros(2, np.float32)})
    verify_graph(graph)
