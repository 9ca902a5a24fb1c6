"""Which outputs of a compiled function a loop passes back in as its next arguments, without
donation: `params = step(params, x)` or `params, loss = step(params, x)`. Those results are
the next call's arguments, held once: counted among its arrays passed in, not again as the
previous call's results (report/loop_peak.py). Measured: such a loop's VmHWM is the returned
parameters' bytes below that of `new, loss = step(params, x)`, which keeps them apart, and
the checked mode counts them once (BENCHMARKS.md, issue 30's memory table).

The rule is the pytree's and the graph's: an output (the whole result, or one element of a
returned tuple, list or dict) with the structure, shapes and dtypes of a whole argument of two
or more tensors that is not donated, each of whose leaves is computed from that argument's
leaf by elementwise ops (an optimizer's update: `p - lr * g`, `b1 * m + (1 - b1) * g`), is
that argument's next value. Gradients are not (a gradient returned as it is, or clipped, is
computed from the backward's result: `grads = step(params, x)` keeps them apart), nor is a
single array of an argument's type (`y = f(w, x)` with y shaped as x): those stay counted as
kept results. Donating an argument (donate_argnums) says it goes back in, whatever its shape.
"""

from __future__ import annotations

from backplan.ir.registry import get_op

from .pytree import TreeDef

CONTAINERS = ("tuple", "list", "dict", "namedtuple", "dataclass", "custom")


def passed_back_outputs(
    call, trace, out_treedef: TreeDef, out_slots: list, out_leaves: list, donated=frozenset()
) -> frozenset:
    """Graph output indices of the outputs a loop passes back in (see the module). donated:
    the names of the donated arguments."""
    arguments = _argument_trees(call, donated)
    graph, gradients = trace.graph, set(trace.inlined_gradients)
    found: set[int] = set()
    for tree, start in _candidate_trees(out_treedef):
        slots = out_slots[start : start + tree.num_leaves]
        if len(slots) < 2 or any(kind != "tensor" for kind, _ in slots):
            continue
        types = [_type(out_leaves[start + k]) for k in range(len(slots))]
        for i, (arg_tree, arg_types, positions) in enumerate(arguments):
            if arg_tree != tree or arg_types != types:
                continue
            inputs = [graph.inputs[call.tensor_positions.index(p)] for p in positions]
            outputs = [graph.outputs[index] for _, index in slots]
            if all(
                arg in _elementwise_sources(out, gradients)
                for arg, out in zip(inputs, outputs, strict=True)
            ):
                found.update(index for _, index in slots)
                del arguments[i]  # each argument takes one output
                break
    return frozenset(found)


def _elementwise_sources(value, stop: set) -> set:
    """The values read by the elementwise (and view) ops that compute value, walking back
    until another kind of op or a gradient of an inlined value_and_grad."""
    seen, todo, sources = {value}, [value], {value}
    while todo:
        v = todo.pop()
        if v in stop or not v.inputs or get_op(v.op).fusion not in ("elementwise", "view"):
            continue
        for operand in v.inputs:
            sources.add(operand)
            if operand not in seen:
                seen.add(operand)
                todo.append(operand)
    return sources


def _argument_trees(call, donated) -> list[tuple[TreeDef, list, list]]:
    """(structure, leaf types, leaf positions) of each argument of tensors alone, not
    donated, a container."""
    trees, start = [], 0
    for child in call.key.treedef.children:
        positions = list(range(start, start + child.num_leaves))
        keys = [call.key.leaves[p] for p in positions]
        start += child.num_leaves
        if child.kind not in CONTAINERS or not positions or call.arguments[positions[0]] in donated:
            continue
        if all(k.kind == "tensor" and not k.weak for k in keys):
            trees.append((child, [(tuple(k.shape), k.dtype) for k in keys], positions))
    return trees


def _candidate_trees(out_treedef: TreeDef):
    """(subtree, its first leaf's index): the whole result, then each element of it."""
    yield out_treedef, 0
    if out_treedef.kind not in CONTAINERS:
        return
    start = 0
    for child in out_treedef.children:
        yield child, start
        start += child.num_leaves


def _type(leaf) -> tuple:
    return tuple(leaf.shape), leaf._ir_dtype
