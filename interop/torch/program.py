"""The imported function: walks the exported graph once per call, computing each node with
backplan ops under the node's own source location. Called eagerly it runs eagerly; inside
bp.compile or bp.value_and_grad the same calls trace into one backplan graph."""

from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from backplan.tracer import ops
from backplan.tracer import random as bp_random
from backplan.tracer.dlpack import from_dlpack
from backplan.tracer.source import at_location
from backplan.tracer.tensor import Tensor

from . import aten_math, aten_nn, aten_shape  # noqa: F401  (they fill the table)
from .capture import op_name
from .errors import TorchImportError
from .locations import node_location, where
from .state import check_params
from .table import TABLE, Context

_PLACEMENT = ("device", "layout", "pin_memory", "memory_format", "non_blocking")


@dataclass
class Step:
    """One call_function node, resolved at import time."""

    node: object
    handler: object
    loc: object
    place: str


class ImportedGraph:
    """The exported program's facts backplan needs per call, worked out once."""

    def __init__(self, program: ExportedProgram, module: torch.nn.Module, owner: str):
        """Placeholders' sources, the state_dict's shapes, each node's handler and location,
        the dropout count and the output kinds, read once from the exported program."""
        self.owner = owner
        self.in_spec = program.call_spec.in_spec
        self.out_spec = program.call_spec.out_spec
        self.sources = _sources(program, module)
        self.expected = {
            name: (tuple(v.shape), np.dtype(str(v.dtype).removeprefix("torch.")))
            for name, v in module.state_dict().items()
        }
        self.steps = [
            Step(n, TABLE.get(op_name(n)), node_location(n, owner), where(n, owner))
            for n in program.graph.nodes
            if n.op == "call_function"
        ]
        self.dropouts = sum(1 for s in self.steps if _draws(s.node))
        self.outputs = list(program.graph_signature.output_specs)
        values = {n.name: n.meta.get("val") for n in program.graph.nodes}
        self.output_shapes = [
            tuple(getattr(values[s.arg.name], "shape", ()))
            for s in self.outputs
            if s.kind == OutputKind.USER_OUTPUT
        ]
        self.user_inputs = [
            _example_type(n)
            for n in program.graph.nodes
            if n.op == "placeholder" and self.sources[n.name][0] == "user"
        ]

    @property
    def mutates(self) -> bool:
        return any(s.kind == OutputKind.BUFFER_MUTATION for s in self.outputs)

    def run(self, params, args, kwargs, key):
        check_params(params, self.expected, self.owner)
        flat = self._inputs(args, kwargs)
        env = {}
        for name, (kind, what) in self.sources.items():
            env[name] = (
                params[what] if kind == "param" else what if kind == "constant" else flat[what]
            )
        ctx = Context(next_key=self._keys(key))
        for step in self.steps:
            env[step.node.name] = self._compute(step, env, ctx)
        return self._results(env)

    def _inputs(self, args, kwargs) -> list:
        flat, spec = torch.utils._pytree.tree_flatten((tuple(args), dict(kwargs)))
        if spec != self.in_spec:
            raise TorchImportError(
                f"{self.owner}: called with {_arguments(spec)}, imported with "
                f"{_arguments(self.in_spec)} (torch.export fixes the call's structure)"
            )
        return [
            self._input(i, v, e)
            for i, (v, e) in enumerate(zip(flat, self.user_inputs, strict=True))
        ]

    def _input(self, i: int, value, example):
        """A tensor input of the example's shape and dtype, or a Python value equal to the
        example's (torch.export fixed both into the graph)."""
        if not isinstance(example, tuple):
            if isinstance(value, Tensor | np.ndarray) or value != example:
                raise TorchImportError(
                    f"{self.owner}: input {i} is {value!r}, the module was imported with "
                    f"{example!r}, which torch.export fixed into the graph; import it again "
                    "with this value"
                )
            return value
        shape, dtype = example
        tensor = value if isinstance(value, Tensor) else _as_tensor(value)
        if tensor.shape != shape or tensor.dtype != dtype:
            raise TorchImportError(
                f"{self.owner}: input {i} is {tensor.dtype}{list(tensor.shape)}, the module "
                f"was imported with {dtype}{list(shape)}; torch.export fixes the shapes, so "
                "import it again with an example of this shape"
            )
        return tensor

    def _keys(self, key):
        """A function handing each active dropout its own key, split from `key` once per call;
        asking without a key says how to pass one."""
        keys, used = [], [0]
        if self.dropouts and key is not None:
            keys = [key] if self.dropouts == 1 else list(bp_random.split(key, self.dropouts))

        def next_key(what: str):
            if not keys:
                raise TorchImportError(
                    f"{self.owner} is in training mode and has {self.dropouts} dropout(s): pass "
                    "a key, fn(params, *args, key=bp.random.key(0)) (a new key per step), or "
                    "import module.eval()"
                )
            used[0] += 1
            return keys[used[0] - 1]

        return next_key

    def _compute(self, step: Step, env: dict, ctx: Context):
        """One node: getitem picks an output (refusing ones backplan does not compute); any
        other op runs its handler under the node's source location."""
        node = step.node
        args = torch.fx.node.map_arg(node.args, lambda n: env[n.name])
        if node.target is operator.getitem:
            value = args[0][args[1]]
            if value is None:
                raise TorchImportError(
                    f"{self.owner}: {node.args[0].target} output {args[1]} at {step.place} is "
                    "read, and backplan does not compute it (saved statistics, pooling indices)"
                )
            return value
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: env[n.name])
        kwargs = {k: v for k, v in kwargs.items() if k not in _PLACEMENT}
        with at_location(step.loc):
            try:
                if step.handler.wants_context:
                    return step.handler(ctx, *args, **kwargs)
                return step.handler(*args, **kwargs)
            except TorchImportError as exc:  # a mapping's refusal: name the module and line
                raise TorchImportError(f"{self.owner}: {exc}, at {step.place}") from None

    def _results(self, env):
        user, buffers = [], {}
        for spec in self.outputs:
            value = env[spec.arg.name]
            if spec.kind == OutputKind.BUFFER_MUTATION:
                buffers[spec.target] = value
            else:
                user.append(value)
        output = torch.utils._pytree.tree_unflatten(user, self.out_spec)
        return (output, buffers) if self.mutates else output


def _sources(program: ExportedProgram, module: torch.nn.Module) -> dict[str, tuple]:
    """Each placeholder's source: ("param", state_dict name), ("constant", tensor) for lifted
    constants and non-persistent buffers (not in state_dict), or ("user", flat position)."""
    sources: dict[str, tuple] = {}
    user = 0
    for spec in program.graph_signature.input_specs:
        name = spec.arg.name
        if spec.kind == InputKind.PARAMETER or (
            spec.kind == InputKind.BUFFER and spec.persistent is not False
        ):
            sources[name] = ("param", spec.target)
        elif spec.kind == InputKind.BUFFER:
            sources[name] = ("constant", _constant(module.get_buffer(spec.target)))
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            sources[name] = ("constant", _constant(program.constants[spec.target]))
        else:
            sources[name] = ("user", user)
            user += 1
    return sources


def _draws(node) -> bool:
    """A dropout that is active (training mode, p > 0): it needs a key."""
    return op_name(node) == "aten.native_dropout.default" and node.args[2] and node.args[1] > 0


def _constant(value) -> Tensor:
    return Tensor(value.detach().numpy()) if isinstance(value, torch.Tensor) else value


def _arguments(spec) -> str:
    """`2 positional arguments and keywords ['scale']`, from a flattened (args, kwargs) spec."""
    args, kwargs = spec.child(0), spec.child(1)
    keys = f" and keywords {list(kwargs.context)}" if kwargs.context else ""
    return f"{args.num_children} positional argument(s){keys}"


def _example_type(node):
    """(shape, dtype) of a tensor input; a Python value (an int, a float) as it was."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return value
    return tuple(value.shape), np.dtype(str(value.dtype).removeprefix("torch."))


def _as_tensor(value) -> Tensor:
    """An eager call's input: a torch tensor through DLPack (a bfloat16 one has no NumPy view
    np.asarray could take), anything else through NumPy."""
    if hasattr(value, "__dlpack__") and not isinstance(value, np.ndarray):
        return from_dlpack(value)
    return ops.as_tensor(np.asarray(value))
