"""What the pipeline builds (ir/pipeline.py): the plans of one step, in one of two forms that
every caller reads through the same few members (`StepPlans`), so none asks which form it holds.

A compiled function's region is a RegionPlans: a forward plan (the outputs, then the values it
saves) now and a backward plan reading saved buffers later. value_and_grad's step is a
JointPlans: one joint plan, forward and gradients together. Both say which plans a step runs
(`named`), what the memory accounting walks (`peak_calls`), the bytes held from forward to
backward (`saved_bytes`) and which forward value a backward input stands for."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from .graph import Value
from .layout import storage_root
from .liveness import Plan
from .lowering import BackwardMode, LoweredPlan, lower
from .peak import PlanCall, joint_calls, region_calls
from .types import is_float

if TYPE_CHECKING:
    from .pipeline import PassLog


class StepPlans(Protocol):
    """The members every caller of a build uses (RegionPlans and JointPlans have them)."""

    n_outputs: int  # the function's own outputs (a joint plan's gradients follow them)
    wrt: list[bool]

    @property
    def named(self) -> dict[str, Plan]: ...

    def peak_calls(self, consume: bool = True) -> list[PlanCall]: ...

    @property
    def saved_bytes(self) -> int: ...

    def held_forward_values(self) -> dict[Value, Value]: ...

    def lowered(self, mode: BackwardMode | None = None) -> LoweredPlan: ...


@dataclass
class SavedSlot:
    """Where a saved buffer comes from when the forward runs: ("input", i) is region input i,
    ("output", j) is forward-plan output j. `forward` is the forward value, `reason` the rule."""

    source: tuple[str, int]
    forward: Value
    reason: str


@dataclass
class RegionPlans:
    """Everything needed to run a region forward now and backward later."""

    forward: Plan  # outputs: the user's outputs, then the saved values it computes
    backward: Plan | None  # inputs: one cotangent per float output, then the saved buffers
    saved: list[SavedSlot]
    n_outputs: int
    wrt: list[bool]
    log: PassLog
    recomputed: list = field(default_factory=list)  # remat.Recomputed: rebuilt, not saved
    # a step whose gradients are inlined value_and_grad plans: the forward plan's nodes its
    # inlined losses depend on (what the rest reads from them is what it holds for them)
    inlined_forward: frozenset | None = None
    # a training step: its optimizer updates' order, traced or right after their gradients,
    # and the peaks of both (ir/update_order.py UpdateOrder; None: nothing to move)
    update_order: object = None
    # a step with inlined gradients and saved_dtype: what it narrowed (as JointPlans')
    narrowing: object = None

    @property
    def n_cotangents(self) -> int:
        """Backward inputs before the saved buffers: one per float user output."""
        return sum(is_float(o.dtype) for o in self.forward.graph.outputs[: self.n_outputs])

    @property
    def donated(self) -> tuple[int, ...]:
        """Forward inputs whose buffers its outputs may be written into."""
        return self.forward.donated

    def private_saved_inputs(self) -> tuple[int, ...]:
        """Backward inputs holding saved buffers that only this region's graph can see:
        computed by the forward, not a user output, not sharing storage with one."""
        forward = self.forward.graph
        public = {storage_root(v) for v in forward.outputs[: self.n_outputs]}
        public |= set(forward.inputs)
        return tuple(
            self.n_cotangents + slot
            for slot, saved in enumerate(self.saved)
            if saved.source[0] == "output" and storage_root(saved.forward) not in public
        )

    def lowered(self, mode: BackwardMode | None = None) -> LoweredPlan:
        """The forward plan lowered (mode None), or the backward plan in that mode."""
        if mode is None:
            return lower(self.forward)
        private = self.private_saved_inputs() if mode is BackwardMode.CONSUME else ()
        return lower(self.backward, private)

    @property
    def named(self) -> dict[str, Plan]:
        """The plans one step runs, by the names explain gives them."""
        named = {"forward": self.forward}
        if self.backward is not None:
            named["backward"] = self.backward
        return named

    def peak_calls(self, consume: bool = True) -> list[PlanCall]:
        """The forward's call, then the backward's (consume: without retain_graph)."""
        return region_calls(self, consume)

    @property
    def saved_bytes(self) -> int:
        """Bytes of the saved buffers the forward computes (the arrays passed in excluded)."""
        if self.backward is None:
            return 0
        return sum(s.forward.type.nbytes for s in self.saved if s.source[0] == "output")

    def held_forward_values(self) -> dict[Value, Value]:
        """Each saved-buffer input of the backward, and the forward value it holds."""
        if self.backward is None:
            return {}
        inputs = self.backward.graph.inputs[self.n_cotangents :]
        return {b: s.forward for b, s in zip(inputs, self.saved, strict=True)}


@dataclass
class JointPlans:
    """value_and_grad's step: one joint plan whose outputs are the function's (the loss, then
    aux), then the gradients of the loss for the wrt inputs, in input order. Nothing is held
    from one plan to another."""

    plan: Plan
    n_outputs: int
    wrt: list[bool]
    log: PassLog | None = None
    # saved_dtype: what it narrowed and the peaks (ir/saved_dtype.py HeldNarrowing)
    narrowing: object = None
    # a plan recomputing held values: the values its gradient part reads from its forward
    # part, graph inputs left out, as the rewrite knew them (ir/remat.py held_recomputed);
    # None where unknown (report/fused_saved.py then walks the graph)
    held_values: tuple | None = None

    @property
    def named(self) -> dict[str, Plan]:
        return {"joint": self.plan}

    def peak_calls(self, consume: bool = True) -> list[PlanCall]:
        return joint_calls(self.plan, self.n_outputs)

    @property
    def saved_bytes(self) -> int:
        return 0

    def held_forward_values(self) -> dict[Value, Value]:
        return {}

    @property
    def donated(self) -> tuple[int, ...]:
        return self.plan.donated

    def lowered(self, mode: BackwardMode | None = None) -> LoweredPlan:
        return lower(self.plan)
