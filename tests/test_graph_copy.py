"""copy_graph (ir/graph.py) sets each copy's slots directly, not through Value's constructor:
every slot must still be what the constructor would give, the inputs the copies' own, the
attributes a dict of the copy's own, and every value new."""

from backplan.ir.graph import Graph, Value, copy_graph
from backplan.ir.types import TensorType


def _graph() -> Graph:
    graph = Graph(name="g")
    x = graph.add_input(TensorType("f32", (4, 3)), role="arg", loc=("model.py", 3))
    w = graph.add_input(TensorType("f32", (3, 2)), role="saved")
    t = Value("transpose", [w], {"perm": (1, 0)}, TensorType("f32", (2, 3)), ("model.py", 4))
    y = Value("matmul", [x, w], {}, TensorType("f32", (4, 2)), ("model.py", 5))
    z = Value("mul", [y, y], {}, TensorType("f32", (4, 2)))
    graph.nodes = [t, y, z]
    graph.outputs = [z, t]
    graph.reasons[y] = "mul reads it"
    return graph


def test_a_copied_value_is_what_the_constructor_makes_of_the_copied_inputs():
    graph = _graph()
    new, mapping = copy_graph(graph)
    assert [mapping[v] for v in graph.inputs + graph.nodes] == new.inputs + new.nodes
    slots = [s for s in Value.__slots__ if s != "uid"]
    for old, copy in zip(graph.nodes, new.nodes, strict=True):
        made = Value(old.op, [mapping[i] for i in old.inputs], old.attrs, old.type, old.loc)
        assert {s: getattr(copy, s) for s in slots} == {s: getattr(made, s) for s in slots}
        assert all(i in new.inputs + new.nodes for i in copy.inputs)
        assert copy.attrs is not old.attrs  # a pass changing one never changes the other
    assert new.outputs == [mapping[o] for o in graph.outputs]
    assert new.reasons == {mapping[graph.nodes[1]]: "mul reads it"}
    uids = {v.uid for v in graph.inputs + graph.nodes + new.inputs + new.nodes}
    assert len(uids) == 2 * (len(graph.inputs) + len(graph.nodes))
