"""The NumPy reference interpreter: runs any plan with the registry's reference implementations,
freeing each value at its `free` statement. It is the oracle every compiled result is checked
against."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .errors import ExecutionError
from .graph import Graph, Value
from .liveness import INPUT_STEP, Plan
from .reference_storage import VIEW_OPS, fresh
from .registry import get_op
from .rounding_points import Recomputed, Widened
from .text import format_loc
from .types import compute_dtype, is_half, np_dtype
from .widen import compute_attrs, computes_in_float32


def evaluate(node: Value, arrays: list, constants: dict) -> np.ndarray:
    """One node's value. An op on bfloat16 or float16 computes in float32 and rounds its result
    once, as compiled kernels do (ir/widen.py)."""
    if node.op == "const":
        return constants[node.attrs["name"]]
    attrs = node.attrs
    if computes_in_float32(node):
        arrays = [a.astype(np.float32) if is_half(_name(a)) else a for a in arrays]
        attrs = compute_attrs(attrs)
    elif node.op == "astype" and is_half(node.dtype) and arrays[0].dtype != np.float32:
        arrays = [arrays[0].astype(np.float32)]  # into 16 bits from float32 only, as compiled
    try:
        result = get_op(node.op).reference(*arrays, **attrs)
    except (IndexError, ValueError) as exc:
        where = f" at {format_loc(node.loc)}" if node.loc else ""
        raise ExecutionError(f"{node.op}{where}: {exc}") from None
    if is_half(node.dtype):
        result = np.asarray(result, dtype=np_dtype(compute_dtype(node.dtype)))
    result = np.asarray(result, dtype=np_dtype(node.dtype))
    return result if node.op in VIEW_OPS else fresh(result, arrays)


def _name(array) -> str:
    kind = np.asarray(array).dtype
    return "bf16" if kind.name == "bfloat16" else "f16" if kind == np.float16 else ""


def run_plan(
    plan: Plan,
    args: list,
    release: Callable[[int], None] | None = None,
    on_step: Callable[[int, dict], None] | None = None,
) -> list[np.ndarray]:
    """Run plan on args. The list is emptied, so the plan holds the only reference it made.
    release(i) is called when input i is freed: its owner drops its own reference then.
    16-bit values are rounded after every op, except where the plan says a compiled loop
    keeps the float32 value (`unrounded`, `reads_instead`: the plan a lowering gives the
    interpreter, `lower(plan).interpreted`; ir/rounding_points.py)."""
    graph, unrounded, reads_instead = plan.graph, plan.unrounded, plan.reads_instead
    env: dict[Value, np.ndarray] = dict(zip(graph.inputs, args, strict=True))
    args.clear()
    input_index = {v: i for i, v in enumerate(graph.inputs)}

    def free(step: int) -> None:
        for value in plan.frees_after.get(step, ()):
            env.pop(value, None)
            if release is not None and value in input_index:
                release(input_index[value])

    constants = graph.constants
    with np.errstate(all="ignore"):
        free(INPUT_STEP)
        for step, node in enumerate(graph.nodes):
            wide = unrounded.get(node)
            if wide is not None:  # not rounded, as the compiled loop computing it
                env[node] = np.array(_spec(wide, env, constants))
            else:  # no local holds the inputs: each is freed at its own step
                swaps = reads_instead.get(node)
                env[node] = evaluate(node, _inputs(node, env, swaps, constants), constants)
            if on_step is not None:
                on_step(step, env)
            free(step)
    outputs = [env[o] for o in graph.outputs]
    free(plan.return_step)
    return outputs


def _inputs(node: Value, env: dict, swaps: dict | None, constants: dict) -> list:
    if swaps is None:
        return [env[i] for i in node.inputs]
    return [_read(i, swaps, env, constants) for i in node.inputs]  # its loop reads otherwise


def _read(value: Value, swaps: dict, env: dict, constants: dict):
    """What a node's loop reads as one of its inputs: the input's value, or how the loop
    computes it where that differs (ir/rounding_points.py)."""
    instead = swaps.get(value)
    return env[value] if instead is None else _spec(instead, env, constants)


def _spec(spec, env: dict, constants: dict):
    if isinstance(spec, Widened):
        return np.asarray(_spec(spec.of, env, constants)).astype(np_dtype(spec.dtype))
    if isinstance(spec, Recomputed):
        return evaluate(spec.node, [_spec(i, env, constants) for i in spec.inputs], constants)
    return env[spec]


def run_graph(graph: Graph, args: list) -> list[np.ndarray]:
    """Run a bare graph (no plan): the simplest oracle, keeping every value until the end."""
    env = dict(zip(graph.inputs, args, strict=True))
    with np.errstate(all="ignore"):
        for node in graph.nodes:
            env[node] = evaluate(node, [env[i] for i in node.inputs], graph.constants)
    return [env[o] for o in graph.outputs]
