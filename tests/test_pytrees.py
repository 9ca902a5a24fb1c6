"""Pytrees: dataclasses (frozen or not) and registered classes through compile,
value_and_grad and export; the public bp.tree functions."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import backplan as bp


@dataclasses.dataclass(frozen=True)
class Params:
    w: bp.Tensor
    b: bp.Tensor


@dataclasses.dataclass
class Output:
    loss: bp.Tensor
    hidden: bp.Tensor
    note: str = "step"


class Pair:
    """A plain class made a pytree node with bp.tree.register."""

    def __init__(self, first, second, tag: str):
        self.first, self.second, self.tag = first, second, tag


bp.tree.register(Pair, lambda p: ((p.first, p.second), p.tag), lambda tag, kids: Pair(*kids, tag))


def _params():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 2)).astype(np.float32)
    return Params(
        bp.tensor(w, requires_grad=True), bp.tensor(np.zeros(2, np.float32), requires_grad=True)
    )


def model(p: Params, x) -> Output:
    hidden = bp.tanh(x @ p.w + p.b)
    return Output(loss=(hidden * hidden).sum(), hidden=hidden)


X = bp.tensor(np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3))


def test_dataclasses_are_arguments_and_outputs_of_compile():
    params = _params()
    out = bp.compile(model)(params, X)
    assert isinstance(out, Output) and out.note == "step" and out.hidden.shape == (4, 2)
    out.loss.backward()
    eager_params = _params()
    model(eager_params, X).loss.backward()
    np.testing.assert_allclose(params.w.grad.numpy(), eager_params.w.grad.numpy(), rtol=1e-6)


def test_value_and_grad_returns_gradients_in_the_dataclass():
    loss, grads = bp.value_and_grad(lambda p, x: model(p, x).loss)(_params(), X)
    assert isinstance(grads, Params) and grads.w.shape == (3, 2)
    params = _params()
    model(params, X).loss.backward()
    np.testing.assert_allclose(grads.b.numpy(), params.b.grad.numpy(), rtol=1e-6)


def test_registered_classes_pass_through_compile():
    @bp.compile
    def swap(pair: Pair) -> Pair:
        return Pair(pair.second * 2.0, pair.first, pair.tag + "!")

    out = swap(Pair(bp.tensor([1.0]), bp.tensor([3.0]), "t"))
    assert isinstance(out, Pair) and out.tag == "t!" and out.first.tolist() == [6.0]


def test_export_stores_dataclasses_as_dicts_and_refuses_registered_classes(tmp_path):
    step = bp.value_and_grad(lambda p, x: model(p, x).loss)
    path = str(tmp_path / "step.bpz")
    bp.export(step, _params(), X, path=path)
    loaded = bp.load(path)
    loss, grads = loaded(_params(), X)  # a dataclass stands where its dict of fields was
    want_loss, want = step(_params(), X)
    assert set(grads) == {"w", "b"}  # the class itself needs the model's code
    np.testing.assert_allclose(grads["w"].numpy(), want.w.numpy(), rtol=1e-6)
    assert loss.item() == pytest.approx(want_loss.item())

    @bp.compile
    def first(pair: Pair):
        return pair.first * 2.0

    with pytest.raises(bp.ExportError, match="registered with bp.tree.register"):
        bp.export(
            first, Pair(bp.tensor([1.0]), bp.tensor([2.0]), "t"), path=str(tmp_path / "p.bpz")
        )


@pytest.mark.parametrize(
    "first, second, where",
    [
        ({"a": [1, 2]}, {"a": [1]}, r"at \['a'\]: 2 items against 1"),
        ({"a": (1, 2)}, {"a": [1, 2]}, r"at \['a'\]: a tuple of 2 against a list of 2"),
        ([{"b": {"x": 1}}], [{"b": {"x": None}}], r"at \[0\]\['b'\]\['x'\]: a leaf against None"),
        ({"w": 1, "b": 2}, {"b": 2, "w": 1}, r"the same keys in another order"),
        (Pair(1, 2, "x"), Pair(1, [2], "x"), r"at \[1\]: a leaf against a list of 1"),
        ([1, Params(1, 2)], [1, Pair(1, 2, "x")], r"at \[1\]: a Params against a Pair"),
    ],
)
def test_structure_mismatches_name_the_place(first, second, where):
    with pytest.raises(ValueError, match=where):
        bp.tree.map(lambda a, b: a, first, second)


def test_tree_functions():
    params = {"w": bp.ones((2,)), "layers": [bp.zeros((1,)), None], "pair": Pair(1, 2, "x")}
    leaves, treedef = bp.tree.flatten(params)
    assert len(leaves) == 4 == treedef.num_leaves and bp.tree.leaves(params)[2:] == [1, 2]
    rebuilt = bp.tree.unflatten(treedef, leaves)
    assert rebuilt["layers"][1] is None and rebuilt["pair"].tag == "x"
    grads = bp.tree.map(lambda leaf: leaf, params)
    summed = bp.tree.map(lambda a, b: a + b, params, grads)
    assert summed["w"].tolist() == [2.0, 2.0] and summed["pair"].second == 4
    with pytest.raises(ValueError, match=r"keys only the first has: \['layers', 'pair'\]"):
        bp.tree.map(lambda a, b: a, params, {"w": 1})
    with pytest.raises(ValueError, match="leaves"):
        bp.tree.unflatten(treedef, leaves[:2])
    frozen = Params(bp.ones((1,)), bp.zeros((1,)))
    assert bp.tree.map(lambda t: t + 1.0, frozen).b.tolist() == [1.0]


def test_a_per_structure_unflattener_rebuilds_what_unflatten_does():
    from collections import namedtuple

    from backplan.tracer.pytree import unflattener

    Point = namedtuple("Point", "x y")
    trees = [
        {"a": 1, "b": 2},
        {"a": [1, (2, None)], "b": {"c": 3}},
        (1, [2, 3], {"d": Point(4, 5)}),
        Params(1, 2),
        7,
        [],
    ]
    for tree in trees:
        leaves, treedef = bp.tree.flatten(tree)
        rebuild = unflattener(treedef)
        assert rebuild(leaves) == bp.tree.unflatten(treedef, leaves) == tree
        assert rebuild([leaf * 10 for leaf in leaves]) == bp.tree.map(lambda v: v * 10, tree)
    with pytest.raises(ValueError, match="has 2 leaves, got 3"):
        unflattener(bp.tree.structure({"a": 1, "b": 2}))([1, 2, 3])


def test_a_class_registered_after_it_was_a_leaf_becomes_a_node():
    """Node kinds are worked out once per type; registering must forget the earlier answer."""

    class Box:
        def __init__(self, inner):
            self.inner = inner

    box = Box([1, 2])
    assert bp.tree.leaves({"b": box}) == [box]
    bp.tree.register(Box, lambda b: ((b.inner,), None), lambda aux, kids: Box(*kids))
    assert bp.tree.leaves({"b": box}) == [1, 2]
    rebuilt = bp.tree.map(lambda v: v * 10, {"b": box})
    assert isinstance(rebuilt["b"], Box) and rebuilt["b"].inner == [10, 20]


def test_flatten_paths_name_every_kind_of_node():
    Point = __import__("collections").namedtuple("Point", "x y")
    tree = {"p": Params(1, 2), "q": [Point(3, 4), (5,)], "r": Pair(6, None, "t")}
    leaves, _, paths = bp.tree.flatten(tree, paths=True)
    assert leaves == [1, 2, 3, 4, 5, 6]
    assert paths == ["['p'].w", "['p'].b", "['q'][0].x", "['q'][0].y", "['q'][1][0]", "['r'][0]"]


def test_zero_grad_clears_every_tensor_in_nested_containers():
    params = _params()
    model(params, X).loss.backward()
    tree = {"params": params, "extra": [params.w, 3, None]}
    assert params.w.grad is not None and params.b.grad is not None
    bp.zero_grad(tree)
    assert params.w.grad is None and params.b.grad is None


def test_leaves_walk_matches_flatten_on_every_kind_of_node():
    Point = __import__("collections").namedtuple("Point", "x y")
    tree = {"a": [1, (2, None)], "p": Params(3, Point(4, 5)), "r": Pair(6, [7], "t"), "z": None}
    assert bp.tree.leaves(tree) == bp.tree.flatten(tree)[0] == [1, 2, 3, 4, 5, 6, 7]


def test_an_unregistered_object_holding_tensors_is_refused_not_frozen_into_the_plan():
    """As one static value it was keyed by identity: changing its tensor gave stale results."""

    class Holder:
        def __init__(self, w):
            self.w = w

    f = bp.compile(lambda p: bp.sum(p.w * 2.0))
    holder = Holder(bp.tensor(np.ones(3, np.float32)))
    with pytest.raises(
        bp.TracingError, match=r"argument p is a Holder object holding tensors \(\.w\)"
    ):
        f(holder)
    holder.w = [np.ones(2)]  # arrays inside containers count too
    with pytest.raises(bp.TracingError, match="bp.tree.register"):
        f(holder)
    act = bp.compile(lambda x, fn: fn(x).sum())  # functions stay usable as static arguments
    assert act(bp.tensor(np.zeros(3, np.float32)), bp.tanh).item() == 0.0


def test_zero_grad_refuses_an_object_whose_tensors_it_cannot_see():
    class Box:
        def __init__(self, t):
            self.t = t

    t = bp.tensor(np.ones(2, np.float32), requires_grad=True)
    (t * t).sum().backward()
    with pytest.raises(TypeError, match=r"a Box object holds tensors \(\.t\)"):
        bp.zero_grad([Box(t)])
    bp.zero_grad([t, "name", 3])  # plain non-tensor leaves are fine
    assert t.grad is None


@dataclasses.dataclass
class Layer:
    w: bp.Tensor
    b: bp.Tensor
    act: str = bp.tree.static_field(default="tanh")


def layer_loss(layer, x):
    h = x @ layer.w + layer.b
    h = bp.tanh(h) if layer.act == "tanh" else bp.relu(h)
    return bp.sum(h * h)


def numpy_layer_loss(w, b, x, act):
    h = x @ w + b
    h = np.tanh(h) if act == "tanh" else np.maximum(h, 0)
    return np.sum(h * h)


def test_a_static_dataclass_field_is_structure_not_a_leaf():
    rng = np.random.default_rng(0)
    w, b = rng.standard_normal((3, 4)), rng.standard_normal(4)
    x = rng.standard_normal((5, 3))
    layer = Layer(bp.tensor(w), bp.tensor(b))
    leaves, treedef = bp.tree.flatten(layer)
    assert len(leaves) == 2 and bp.tree.unflatten(treedef, leaves).act == "tanh"
    assert bp.tree.flatten(Layer(1, 2, "relu"))[1] != treedef  # the value is in the structure

    vg = bp.value_and_grad(bp.compile(layer_loss))
    for act in ("tanh", "relu", "tanh"):
        value, grads = vg(dataclasses.replace(layer, act=act), bp.tensor(x))
        assert isinstance(grads, Layer) and grads.act == act  # gradients keep the static field
        np.testing.assert_allclose(value.item(), numpy_layer_loss(w, b, x, act), rtol=1e-10)
    info = vg.cache_info()
    assert info.traces == 2 and "static fields {'act': 'tanh'} against" in info.last_miss_reason

    opt = bp.optim.adam(0.1)
    state = opt.init(layer)
    new, state = opt.update(grads, state, layer)
    assert isinstance(new, Layer) and new.act == "tanh"
    assert not np.allclose(new.w.numpy(), w)


@pytest.mark.filterwarnings("ignore::backplan.Float64PromotionWarning")  # float64 meant here
def test_static_fields_are_refused_where_they_would_be_silently_lost():
    with pytest.raises(bp.BackplanError, match=r"static field .act of Layer holds a list"):
        bp.tree.flatten(Layer(1, 2, ["tanh"]))

    @dataclasses.dataclass
    class Named:
        w: bp.Tensor
        name: str = "dense"  # not marked static: a leaf

    with pytest.raises(TypeError, match=r"str leaf at \.name.*bp\.tree\.static_field\(\)"):
        bp.value_and_grad(lambda p: bp.sum(p.w))(Named(bp.ones((2,))))
    with pytest.raises(TypeError, match=r"leaf \.name is a str.*bp\.tree\.static_field\(\)"):
        bp.optim.sgd(0.1).init(Named(bp.ones((2,))))

    layer = Layer(bp.ones((3, 4)), bp.zeros((4,)))
    with pytest.raises(bp.ExportError, match=r"a Layer with static fields \(act\)"):
        bp.export(bp.compile(layer_loss), layer, np.ones((2, 3)), path="unused.bpz")
