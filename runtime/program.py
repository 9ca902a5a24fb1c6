"""A region program: the forward and backward plans of one traced function or eager op, with the
static facts about its saved buffers worked out once and shared by every region that runs it."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from backplan.ir.lowering import BackwardMode, let_go
from backplan.ir.plans import RegionPlans
from backplan.ir.text import format_loc, value_names
from backplan.ir.types import is_float, np_dtype

from .backend import current_backend, make_runner
from .location import loc_text, op_text


@dataclass(frozen=True)
class SavedBufferInfo:
    """What the plan says about one saved buffer, before anything runs."""

    slot: int
    name: str
    op: str
    produced_at: str
    shape: tuple[int, ...]
    dtype: np.dtype  # the NumPy dtype, as Tensor.dtype (the IR's short name is in text only)
    nbytes: int
    read_by: tuple[str, ...]
    last_read_step: int
    reason: str
    is_region_input: bool
    written_step: int = -1  # forward step that writes it; -1 for the region's own inputs
    read_steps: tuple[int, ...] = ()  # backward steps that read it
    # the compiled plan computes it inside the loop that reads it (fusion): never stored
    fused: bool = False
    # a NumPy array the caller passed, copied at the call (tracer/numpy_args.py): backplan's
    # buffer, not the caller's, counted in the saved bytes and the peak
    copy_of_argument: bool = False


class RegionProgram:
    """Runs plans through a runner of the chosen backend (runtime/backend.py); compiled and
    reference runners keep the same contract."""

    def __init__(
        self,
        plans: RegionPlans,
        name: str,
        input_names: list[str] | None = None,
        backend: str | None = None,
        background: bool | None = None,
    ):
        self.plans = plans
        self.background = background  # bp.compile(background=...) for every plan it runs
        self.donated = plans.donated  # forward inputs whose buffers outputs may be written into
        self.name = name
        self.backend = backend  # None: the backend current when it first runs
        self._runners: dict = {}
        self._arenas = None  # _shared_arenas: the compiled forward's and consuming backward's
        self._making_runner = threading.Lock()  # threads calling first share one compile
        self.input_names = input_names  # argument paths of the forward inputs, when known
        self.n_outputs = plans.n_outputs
        outputs = plans.forward.graph.outputs[: plans.n_outputs]
        self.cotangent_slot = {}
        for i, out in enumerate(outputs):
            if is_float(out.dtype):
                self.cotangent_slot[i] = len(self.cotangent_slot)
        self.differentiable_outputs = frozenset(self._differentiable_outputs())
        self.saved_info = self._saved_info() if plans.backward else []
        # per saved buffer: (whether it is a forward input, its index among inputs or outputs)
        self.saved_sources = tuple((s.source[0] == "input", s.source[1]) for s in plans.saved)
        self.joint_step = None  # runtime/joint_step.py: a compiled step's one-plan form
        self.retained = False  # a backward(retain_graph=True) ran since the last forward

    def _differentiable_outputs(self):
        if self.plans.backward is None:
            return []
        from backplan.ir.autodiff import needs_grad

        active = needs_grad(self.plans.forward.graph, self.plans.wrt)
        outputs = self.plans.forward.graph.outputs[: self.n_outputs]
        return [i for i, out in enumerate(outputs) if out in active]

    def _saved_info(self) -> list[SavedBufferInfo]:
        fwd_names = value_names(self.plans.forward.graph)
        bwd = self.plans.backward
        n_cot = len(self.cotangent_slot)
        infos = []
        for slot, saved in enumerate(self.plans.saved):
            bwd_input = bwd.graph.inputs[n_cot + slot]
            read_steps = [i for i, n in enumerate(bwd.graph.nodes) if bwd_input in n.inputs]
            readers = [bwd.graph.nodes[i] for i in read_steps]
            value = saved.forward
            infos.append(
                SavedBufferInfo(
                    slot=slot,
                    name=self._input_name(saved.source[1])
                    if saved.source[0] == "input"
                    else self._value_name(value, fwd_names),
                    op=op_text(value.op, value.loc) if value.op != "input" else "input",
                    produced_at=loc_text(value.loc) if value.loc else "<input>",
                    shape=value.shape,
                    dtype=np_dtype(value.dtype),
                    nbytes=value.type.nbytes,
                    read_by=tuple(f"{n.op} at {format_loc(n.loc)}" for n in readers),
                    last_read_step=bwd.last_read.get(bwd_input, -1),
                    reason=saved.reason,
                    is_region_input=saved.source[0] == "input",
                    written_step=self.plans.forward.first_write.get(value, -1),
                    read_steps=tuple(read_steps),
                )
            )
        return infos

    def _value_name(self, value, names) -> str:
        """A compiled function's values go by their IR names; a one-op eager region's only
        value is the tensor the op returned."""
        return names[value] if self.input_names is not None else "output"

    def _input_name(self, index: int) -> str:
        """How the user calls forward input `index`: its argument path, or `input i`."""
        if self.input_names and index < len(self.input_names):
            return self.input_names[index]
        return f"input {index}"

    def runner(self, mode: BackwardMode | None):
        """The runner of the forward plan (mode None) or of the backward plan in a mode:
        RETAIN keeps the saved buffers intact, CONSUME may reuse private saved buffers as
        scratch after their last read. Made on first use with the backend chosen then. Both
        backward modes compute the same gradients; which one runs is decided when backward()
        is called."""
        backend = self.backend or current_backend()
        runner = self._runners.get((mode, backend))
        if runner is None:
            with self._making_runner:
                runner = self._runners.get((mode, backend))
                if runner is None:
                    runner = self._make_runner(mode, backend)
                    self._runners[(mode, backend)] = runner
        return runner

    def _make_runner(self, mode: BackwardMode | None, backend: str):
        shared = mode is not BackwardMode.RETAIN and self.plans.backward is not None
        arenas = self._shared_arenas(backend) if shared else None
        runner = make_runner(
            self.plans.lowered(mode), backend, background=self.background, arenas=arenas
        )
        for plan in self.plans.named.values():  # a later size keeps no lowering once it runs
            let_go(plan)
        return runner

    def _shared_arenas(self, backend: str):
        """The scratch arenas the forward and the consuming backward draw from (compiled
        plans): a step runs one, then the other, so it holds one arena of the larger's size
        (ir/peak.py PlanCall.shares_arena). A backward(retain_graph=True)'s plan keeps an arena
        of its own: RegionProgram.release_retained frees it alone, and a forward with no
        backward (nothing needs a gradient) keeps its own: no pool on each call. None on the
        reference backend, which keeps nothing between calls."""
        if backend != "numba":
            return None
        if self._arenas is None:
            from backplan.codegen.run.workspace import ArenaPool

            self._arenas = ArenaPool()
        return self._arenas

    def runners(self) -> list:
        """The runners made so far: the forward's, and each backward mode's once it ran."""
        return list(self._runners.values())

    def private_saved_inputs(self) -> tuple[int, ...]:
        return self.plans.private_saved_inputs()

    def run_forward(self, args: list, donate=()) -> list:
        """donate: inputs (among self.donated) whose buffers the caller gives up this call."""
        return self.runner(None)(args, donate=donate)

    def run_backward(self, args: list, mode: BackwardMode, release) -> list:
        if mode is BackwardMode.RETAIN:
            self.retained = True
        return self.runner(mode)(args, release)

    def release_idle(self) -> list:
        """Every plan of this program frees the scratch arenas it keeps idle (made again when
        it next runs): the joint plan of a compiled step runs instead of them from call 3
        (runtime/joint_step.py), and explain counts them as gone from then on. Returns the
        freed arenas' reservations (codegen/run/arena_memory.py)."""
        return [r for runner in list(self._runners.values()) for r in runner.release_idle()]

    def release_retained(self) -> None:
        """A call after one whose loss was backward()ed with retain_graph=True: the plan that
        keeps the saved buffers frees the scratch arena it keeps idle (made again the next
        time it runs), so later calls hold what explain prints for them (peak_on_call) and
        not that arena too; report.retain_peak counts it for the calls that run it."""
        self.retained = False
        for (mode, _), runner in list(self._runners.items()):
            if mode is BackwardMode.RETAIN:
                runner.release_idle()
