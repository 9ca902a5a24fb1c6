"""One entry for every op call: record into the active trace, or run it now (eager).

Eager ops whose inputs require grad become one-op regions holding exactly what the op's
derivative rule saves, through the same pipeline as compiled functions.
"""

from __future__ import annotations

import numpy as np

from backplan.ir.builder import make_value
from backplan.ir.graph import Graph, Value
from backplan.ir.interpreter import evaluate
from backplan.ir.passes import attr_key
from backplan.ir.pipeline import build_region_plans
from backplan.ir.types import TensorType
from backplan.runtime import RegionProgram, is_grad_enabled
from backplan.runtime.execute import run_forward
from backplan.runtime.location import op_text

from .errors import TracingError
from .source import loc_text, user_frame_loc
from .tensor import Tensor
from .trace import current_trace
from .traced_size import active_log, plain

_eager_programs: dict[tuple, RegionProgram] = {}


def apply(op: str, inputs: list, **attrs):
    loc = user_frame_loc()
    for t in inputs:
        if t._donated is not None:
            t._check_live()
    for name, value in attrs.items():
        if isinstance(value, Tensor):
            raise _tensor_attribute(op, name, value, loc)
    trace = current_trace()
    if trace is not None:
        if active_log() is not None:  # the user's sizes enter the plan as plain ints
            attrs = plain(attrs)
        values = [trace.value_of(t) for t in inputs]
        value = make_value(op, values, attrs, loc)
        trace.graph.nodes.append(value)
        weak = bool(inputs) and all(t._weak for t in inputs)
        return Tensor._traced(value, trace, weak=weak)
    needs = [is_grad_enabled() and t.requires_grad for t in inputs]
    if not any(needs):
        probes = [Value("input", (), {}, TensorType(t._ir_dtype, t.shape)) for t in inputs]
        node = make_value(op, probes, attrs, loc)
        with np.errstate(all="ignore"):  # IEEE results, silent as on every other path
            result = Tensor._from_array(evaluate(node, [t._data for t in inputs], {}))
        if op == "full" and node.shape == ():
            result._scalar = attrs["value"]
        return result
    return _eager_region(op, inputs, attrs, needs, loc)


def _tensor_attribute(op: str, name: str, value, loc) -> TracingError:
    argument = value._float_argument()
    if not value._weak:
        what = f"a tensor {value._ir_dtype}"
    else:
        what = f"the traced float argument {argument}" if argument else "a traced float argument"
    return TracingError(
        f"{op}() at {loc_text(loc)}: its {name} must be a Python number, got {what}. Python "
        "floats passed to a compiled function are traced (a new value does not retrace); "
        "where one must stay a number, mark it static: "
        f"bp.compile(fn, static_argnames=('{argument or 'name'}',))"
    )


def _eager_region(op, inputs, attrs, needs, loc):
    scalars = tuple(t._scalar if not need else None for t, need in zip(inputs, needs, strict=True))
    types = tuple((t._ir_dtype, t.shape) for t in inputs)
    key = (op, attr_key(attrs), types, tuple(needs), scalars, loc, getattr(loc, "key", None))
    program = _eager_programs.get(key)
    if program is None:
        program = _build_eager_program(op, inputs, attrs, needs, scalars, loc)
        if len(_eager_programs) > 4096:
            _eager_programs.clear()
        _eager_programs[key] = program
    args, edges = [], []
    region_inputs = [t for t, s in zip(inputs, scalars, strict=True) if s is None]
    for t, flows in zip(region_inputs, program.plans.wrt, strict=True):
        args.append(t._data)
        if flows:
            edges.append(t._edge())
    outputs, region = run_forward(program, args, edges, loc_text(loc))
    (out,) = outputs
    grad = region is not None and 0 in program.differentiable_outputs
    return Tensor._from_array(out, grad_fn=region if grad else None)


def _build_eager_program(op, inputs, attrs, needs, scalars, loc) -> RegionProgram:
    """A one-op graph. Python-scalar operands become constants inside it, so the derivative
    rebuilds them instead of saving them (`a * 5` saves nothing)."""
    graph = Graph(name=op)
    operands, wrt = [], []
    for t, need, scalar in zip(inputs, needs, scalars, strict=True):
        if scalar is None:
            operands.append(graph.add_input(TensorType(t._ir_dtype, t.shape)))
            wrt.append(need)
        else:
            operands.append(
                make_value("full", [], {"value": scalar, "shape": (), "dtype": t._ir_dtype}, loc)
            )
            graph.nodes.append(operands[-1])
    node = make_value(op, operands, attrs, loc)
    graph.nodes.append(node)
    graph.outputs = [node]
    # remat off: a one-op region saves exactly what its rule names (it holds the input anyway)
    plans = build_region_plans(graph, wrt, remat=False, expand=False)
    return RegionProgram(plans, name=op_text(op, loc), backend="reference")
