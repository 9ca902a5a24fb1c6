"""Invariant checks run after every pass in tests, and on every graph loaded from disk."""

from __future__ import annotations

import numpy as np

from .builder import make_value
from .errors import BackplanError, VerifyError
from .graph import Graph, Value
from .liveness import INPUT_STEP, OWNED_ROLES, Plan
from .text import value_names
from .types import np_dtype


def verify_graph(graph: Graph) -> None:
    """SSA, operands defined before use, and every type re-derived from the registry."""
    defined: set[Value] = set()
    for value in graph.inputs:
        if value.op != "input" or value in defined:
            raise VerifyError(f"bad graph input {value}")
        defined.add(value)
    names = value_names(graph)
    for node in graph.nodes:
        if node in defined:
            raise VerifyError(f"{names[node]} is defined twice")
        for inp in node.inputs:
            if inp not in defined:
                raise VerifyError(
                    f"{names[node]} ({node.op}) reads a value defined later or elsewhere"
                )
        try:
            expected = make_value(node.op, node.inputs, node.attrs).type
        except BackplanError as exc:
            raise VerifyError(f"{names[node]}: {exc}") from None
        if expected != node.type:
            raise VerifyError(
                f"{names[node]} ({node.op}) has type {node.type}, rule gives {expected}"
            )
        if node.op == "const" and node.attrs["name"] not in graph.constants:
            raise VerifyError(f"{names[node]} names a missing constant")
        if node.op == "const":
            array = graph.constants[node.attrs["name"]]
            if not isinstance(array, np.ndarray) or array.dtype != np_dtype(node.dtype):
                raise VerifyError(f"{names[node]}: constant is not a {node.dtype} array")
            if tuple(array.shape) != node.shape:
                raise VerifyError(f"{names[node]}: constant has shape {array.shape}")
        defined.add(node)
    for out in graph.outputs:
        if out not in defined:
            raise VerifyError("an output is not defined in the graph")


def verify_plan(plan: Plan) -> None:
    """Every owned input (saved buffers, cotangents) is freed exactly once, nothing is read after
    it is freed, and nothing is freed before it is written."""
    graph = plan.graph
    verify_graph(graph)
    names = value_names(graph)
    freed_at: dict[Value, int] = {}
    for step, values in plan.frees_after.items():
        for value in values:
            if value in freed_at:
                raise VerifyError(f"{names.get(value, value)} is freed twice")
            freed_at[value] = step
    for value in graph.inputs:
        if value.role in OWNED_ROLES and value not in freed_at:
            raise VerifyError(f"{value.role} input {names[value]} is never freed")
    for step, node in enumerate(graph.nodes):
        for inp in node.inputs:
            if inp in freed_at and freed_at[inp] < step:
                raise VerifyError(f"{names[node]} reads {names[inp]} after it was freed")
    for value, step in freed_at.items():
        written = INPUT_STEP if value.op == "input" else graph.nodes.index(value)
        if step < written:
            raise VerifyError(f"{names[value]} is freed before it is written")
        if value in graph.outputs and step < plan.return_step:
            raise VerifyError(f"output {names[value]} is freed before return")
