"""One view of a training step's plans for explain(): every op as a numbered step (forward steps,
then backward steps) and every buffer with its kind, bytes and the steps it is held over.

A region program (a forward plan and a backward plan) and value_and_grad's joint plan both become
this view, so the report text, the timeline, the DOT graph and the picture read the same facts.
Steps are global: forward step i is step i, backward step j of a region is step n_forward + j.
A buffer is held from its `start` step to its `end` step inclusive, the way the plans count
bytes: a value is live at the step that writes it and until the `free` that follows its last
read. Outputs handed to the caller are held to the end of the step. A view (a transpose, a
reshape NumPy can express without a copy) lives in its input's buffer, as on the reference
interpreter (ir/reference_storage.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from backplan.ir.graph import Value
from backplan.ir.liveness import Plan
from backplan.ir.reference_storage import storage_roots
from backplan.ir.text import format_node, value_names
from backplan.ir.types import TensorType

# input: the caller's array, held by reference (not counted); temporary: freed inside the step;
# saved: written by the forward, read by the backward; output: handed to the caller;
# cotangent: the gradient fed into the backward; gradient: a gradient the backward returns.
KINDS = ("input", "temporary", "saved", "output", "cotangent", "gradient")


@dataclass
class BufferInfo:
    key: str  # unique over the whole view: "f%3" (forward value %3), "b%5" (backward value %5)
    name: str  # what the user sees: "%3", "x", "params['w0']", "grad x"
    type: TensorType
    kind: str
    start: int
    end: int
    producer: int | None = None  # global step that writes it; None for inputs
    saved: bool = False  # read by the backward after the forward wrote it
    readers: list[int] = field(default_factory=list)  # global steps that read it
    view_of: str | None = None  # a NumPy view lives in this buffer (key), holding it longer

    @property
    def nbytes(self) -> int:
        return self.type.nbytes

    @property
    def phase(self) -> str:
        return "backward" if self.key.startswith("b") else "forward"

    @property
    def counted(self) -> bool:
        """Whether it adds to the bytes the step holds: the caller's own arrays and views
        (counted in the buffer they view) do not."""
        return self.kind != "input" and self.view_of is None


@dataclass(frozen=True)
class StepInfo:
    index: int  # global step
    phase: str  # "forward" or "backward"
    label: str  # "f3" or "b5": the phase and the step within that phase's IR
    node: Value
    text: str  # the node's line of its IR
    writes: str  # buffer key
    reads: tuple[str, ...]  # buffer keys

    @property
    def op(self) -> str:
        return self.node.op


@dataclass
class PlanView:
    name: str
    steps: list[StepInfo]
    buffers: dict[str, BufferInfo]
    joint: bool  # one plan holding forward and backward (value_and_grad)

    @property
    def n_forward(self) -> int:
        return sum(1 for s in self.steps if s.phase == "forward")

    @property
    def n_backward(self) -> int:
        return len(self.steps) - self.n_forward

    def live_bytes(self) -> list[int]:
        """Bytes held at each global step, not counting the caller's own arrays."""
        delta = [0] * (len(self.steps) + 1)
        for buf in self.buffers.values():
            start, end = max(buf.start, 0), min(buf.end, len(self.steps) - 1)
            if buf.counted and start <= end:
                delta[start] += buf.nbytes
                delta[end + 1] -= buf.nbytes
        series, live = [], 0
        for change in delta[:-1]:
            live += change
            series.append(live)
        return series

    def timeline_buffers(self) -> list[BufferInfo]:
        """Buffers that are held at some step: everything the step allocates, and the caller's
        arrays the backward keeps a reference to."""
        return [
            b
            for b in self.buffers.values()
            if b.start <= b.end and b.end >= 0 and (b.counted or b.saved)
        ]


def free_steps(plan: Plan) -> dict[Value, int]:
    """The step after which each value is freed."""
    return {v: step for step, values in plan.frees_after.items() for v in values}


def add_plan_steps(
    view: PlanView, plan: Plan, phase: str, prefix: str, offset: int, alias: dict[Value, str]
) -> dict[Value, str]:
    """Append plan's nodes as steps of `phase`; returns the buffer key of each value. `alias`
    maps inputs of this plan to buffers that already exist (a backward's saved inputs)."""
    names = value_names(plan.graph)
    keys = {v: alias.get(v, f"{prefix}{names[v]}") for v in plan.graph.inputs}
    freed = free_steps(plan)
    roots = storage_roots(plan.graph)
    for step, node in enumerate(plan.graph.nodes):
        index = offset + step
        end = offset + min(freed.get(node, plan.return_step), plan.return_step - 1)
        key = keys[node] = f"{prefix}{names[node]}"
        view.buffers[key] = BufferInfo(key, names[node], node.type, "temporary", index, end, index)
        if roots[node] is not node:  # a view: it lives in its input's buffer
            view.buffers[key].view_of = keys[roots[node]]
        reads = tuple(keys[i] for i in node.inputs)
        for read in dict.fromkeys(reads):
            view.buffers[read].readers.append(index)
        view.steps.append(
            StepInfo(index, phase, f"{phase[0]}{step}", node, format_node(node, names), key, reads)
        )
    return keys


def input_label(names: list[str] | None, index: int) -> str:
    if names and index < len(names):
        return names[index]
    return f"input {index}"


def settle_views(view: PlanView) -> None:
    """A buffer is held while any view of it is (views of views reach the owner in order)."""
    for buf in view.buffers.values():
        if buf.view_of is not None:
            owner = view.buffers[buf.view_of]
            owner.end = max(owner.end, buf.end)


def hand_to_caller(buf: BufferInfo, kind: str, last_step: int, name: str | None = None) -> None:
    """An output: the caller holds it to the end of the step."""
    if buf.kind == "temporary":
        buf.kind = kind
    if name is not None and buf.kind == kind:
        buf.name = name
    buf.end = max(buf.end, last_step)


def region_view(program) -> PlanView:
    """The view of a region program: its forward plan, then its backward plan."""
    plans = program.plans
    fwd, bwd = plans.forward, plans.backward
    view = PlanView(program.name, [], {}, joint=False)
    names = value_names(fwd.graph)
    for i, value in enumerate(fwd.graph.inputs):
        key = f"f{names[value]}"
        view.buffers[key] = BufferInfo(
            key, input_label(program.input_names, i), value.type, "input", -1, -1
        )
    fwd_keys = add_plan_steps(view, fwd, "forward", "f", 0, {})
    n_fwd = len(fwd.graph.nodes)
    last = n_fwd + (len(bwd.graph.nodes) if bwd else 0) - 1
    for out in fwd.graph.outputs[: plans.n_outputs]:
        hand_to_caller(view.buffers[fwd_keys[out]], "output", last)
    if bwd is not None:
        _add_backward(view, program, fwd_keys, n_fwd, last)
    settle_views(view)
    return view


def _add_backward(view: PlanView, program, fwd_keys: dict, n_fwd: int, last: int) -> None:
    plans = program.plans
    bwd = plans.backward
    bwd_names = value_names(bwd.graph)
    freed = free_steps(bwd)
    n_cot = len(program.cotangent_slot)
    outputs = plans.forward.graph.outputs
    for index, slot in program.cotangent_slot.items():
        value = bwd.graph.inputs[slot]
        key = f"b{bwd_names[value]}"
        name = f"grad {view.buffers[fwd_keys[outputs[index]]].name}"
        view.buffers[key] = BufferInfo(
            key,
            name,
            value.type,
            "cotangent",
            n_fwd,
            n_fwd + min(freed[value], len(bwd.graph.nodes) - 1),
        )
    alias = {}
    for slot, saved in enumerate(plans.saved):
        value = bwd.graph.inputs[n_cot + slot]
        buf = view.buffers[fwd_keys[saved.forward]]
        alias[value] = buf.key
        buf.saved = True
        buf.kind = "input" if buf.kind == "input" else "saved"
        buf.start = max(buf.start, 0)
        buf.end = max(buf.end, n_fwd + min(freed[value], len(bwd.graph.nodes) - 1))
    bwd_keys = add_plan_steps(view, bwd, "backward", "b", n_fwd, alias)
    wrt_names = [input_label(program.input_names, i) for i, w in enumerate(plans.wrt) if w]
    for out, name in zip(bwd.graph.outputs, wrt_names, strict=True):
        hand_to_caller(view.buffers[bwd_keys[out]], "gradient", last, f"grad {name}")
