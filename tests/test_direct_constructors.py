"""Objects the memory planner makes thousands of a plan, set field by field instead of through
their constructors: copy_graph's values (ir/graph.py) and a single node's kernel
(ir/fusion.py _single). Each must be what its constructor makes: every slot or field equal, the
inputs the copies' own, the attributes a dict of the copy's own, and every value new."""

from dataclasses import fields

from backplan.ir.fusion import NONE_HELD, Kernel, _single
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


def test_a_single_node_kernel_is_what_the_constructor_makes():
    for node in _graph().nodes:
        made = _single("op", node)
        expected = Kernel("op", [node], node.shape, NONE_HELD, NONE_HELD)
        assert made == expected  # every field of the dataclass
        assert {f.name for f in fields(Kernel)} <= set(vars(made))
        assert made.nodes is not expected.nodes and made.all_nodes == [node]
        assert made.computed == [node] and made.epilogue is None
