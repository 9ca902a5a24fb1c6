"""The explain() report: what one training step will do, worked out from its plans before
anything runs. Its numbers are fields (`saved_bytes`, `peak_bytes`, `saved_buffers`, ...); its
text, Graphviz DOT and picture are renderings of the same facts.

Byte counts follow the plans as the reference interpreter runs them: every value is its own
buffer, held from the step that writes it to the `free` after its last read; arrays the caller
passes in are held by the caller and are not counted (the saved-buffer table still lists those
the backward keeps a reference to). Under the numba backend `compiled` adds what the compiled
plans hold instead (scratch arenas, bytes allocated per call), from the code generator's memory
layout, without compiling.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field

from backplan.codegen.build import process_memory
from backplan.ir.liveness import Plan
from backplan.ir.lowering import lower, stored_values
from backplan.ir.peak import PeakReport, building_peak, joint_calls, predicted_peak
from backplan.ir.plans import JointPlans
from backplan.runtime.backend import backend_in_this_thread, current_backend
from backplan.runtime.joint_step import JOINT_FROM_CALL
from backplan.runtime.program import RegionProgram, SavedBufferInfo

from .compiled import CompiledPlanFacts, joint_facts, region_facts
from .frontier import MemoryFrontier
from .inlined_saved import inlined_saved_info, mark_held
from .joint_view import joint_saved_info, joint_view
from .kernels import KernelInfo, kept_float32, kernels_from_groups, planned_groups
from .loop_peak import holding, kept_output_bytes
from .plan_view import PlanView, StepInfo, region_view
from .recomputed import RecomputedInfo, recomputed_infos
from .widened_saved import widened_inlined_info, widened_saved_info

STEP_PLANS = ("forward", "backward (consume)", "joint")  # what one default training step runs
TWO_PLANS = "the forward, then backward()'s plan"
ONE_JOINT_PLAN = (
    "one joint plan, no saved buffers held, while each loss is backward()ed from the default seed"
)


@dataclass(frozen=True)
class CallPeak:
    """The predicted peak of the calls from `first_call` on (until the next CallPeak's), and
    what runs them: a small compiled loss runs two plans, then one joint plan
    (runtime/joint_step.py), whose peak differs."""

    first_call: int
    runs: str
    peak: PeakReport


@dataclass(frozen=True)
class InnerJoint:
    """A value_and_grad plan inlined into a compiled function (a training step): its saved
    values are temporaries of the step's plan, so the step's report lists them from here."""

    plan: Plan
    n_outputs: int
    wrt: tuple
    input_names: list
    name: str
    loc: str  # where the step called it
    choices: object = None  # ir.pipeline.PlanChoices of the joint plan (rebuilt under a budget)
    chosen_for: str | None = None  # the step's budget that made this plan (else the default)

    def report(self, backend: str) -> ExplainReport:
        return joint_report(
            self.plan,
            self.n_outputs,
            list(self.wrt),
            self.input_names,
            self.name,
            backend=backend,
        )


@dataclass
class ExplainReport:
    """See `backplan.explain`."""

    name: str
    view: PlanView
    plans: dict[str, Plan]  # "forward" and "backward", or "joint" for value_and_grad
    saved_buffers: list[SavedBufferInfo]
    kernels: list[KernelInfo]
    traces: int = 1
    retrace_reason: str | None = None
    requires_grad: list[bool] = field(default_factory=list)
    backend: str = "reference"  # the executor the kernels section describes
    recomputed: list[RecomputedInfo] = field(default_factory=list)  # rebuilt, not saved
    compiled: list[CompiledPlanFacts] | None = None  # numba backend only: each compiled plan
    peak_calls: list = field(default_factory=list)  # ir.peak.PlanCall: the step, for `peak`
    inner: list = field(default_factory=list)  # (InnerJoint, its report): inlined joint plans
    frontier_source: Callable | None = None  # () -> MemoryFrontier of this signature's plans
    dynamic: str | None = None  # a symbolic signature: its axis, sizes and memory formulas
    saved_dtype_note: str = ""  # the dtype saved buffers are kept in, and why (saved_dtype)
    joint_step: bool = False  # may run as one joint plan once backward() follows its calls
    # that joint plan's calls (ir.peak.PlanCall), run from call JOINT_FROM_CALL; None: no joint step
    joint_step_calls: list | None = None
    # bp.compile(..., background=True): calls run on the reference interpreter while the
    # kernels build (codegen/run/compiled.py), which the compiled peak does not describe
    background_build: bool = False
    # a call back on two plans after the joint plan ran: both plans, the joint plan idle
    fallback_calls: list | None = None
    # a loss backward()ed with retain_graph=True, then again: the forward, the backward that
    # keeps the saved buffers, then the one that frees them; None without a backward
    retain_calls: list | None = None
    # a step with inlined value_and_grad plans: what its own plan holds for their gradients
    inlined_saved: list | None = None
    # a training step: its optimizer updates' order and the peaks of both orders
    # (ir/update_order.py UpdateOrder), None when no update could move
    update_order: object = None
    # outputs of the step's first plan its function does not hand back (bp.grad's value):
    # a loop keeps none of them (loop_peak_on_call)
    not_returned: frozenset = frozenset()
    # values the unfused plan reads across from its forward part that the compiled plan
    # computes inside the loop reading them (numba): never stored, so in no saved total
    fused_saved: list = field(default_factory=list)
    # what a loop did with the first call's results, seen on this signature's second call
    # (tracer/loop_watch.py LoopObservation): kept, passed back in, let go; None: not seen yet
    loop_observed: object = None
    # the max_peak_bytes the function was compiled with (judged against peak_bytes), or None
    max_peak_bytes: int | None = None
    ran_here: bool = False  # a call of this signature ran compiled in this process
    # steps whose 16-bit result the fused loops keep in float32, rounded where stored
    kept_float32: tuple = ()

    # ---- numbers ------------------------------------------------------------------------------

    @property
    def forward_ir(self) -> str:
        """The forward plan in the standard text form (the whole plan for value_and_grad)."""
        return self.plans.get("forward", self.plans.get("joint")).text()

    @property
    def backward_ir(self) -> str | None:
        """The backward plan's text; None when nothing needs a gradient, or for value_and_grad,
        whose backward is part of the one joint plan in `forward_ir`."""
        plan = self.plans.get("backward")
        return plan.text() if plan is not None else None

    @property
    def saved_bytes(self) -> int:
        """Bytes of every saved buffer, the caller's own inputs the backward reads included."""
        return sum(b.nbytes for b in self.saved_buffers)

    @property
    def saved_input_bytes(self) -> int:
        return sum(b.nbytes for b in self.saved_buffers if b.is_region_input)

    @property
    def inner_saved_bytes(self) -> int:
        """Bytes the value_and_grad plans inlined into this one save for their backward (held
        inside the step, counted in its peak), your own arrays among them included."""
        if self.inlined_saved is not None:
            return sum(b.nbytes for b in self.inlined_saved)
        return sum(r.saved_bytes for _, r in self.inner)

    @property
    def inner_saved_input_bytes(self) -> int:
        """Of inner_saved_bytes, your own arrays (held by reference, not allocated)."""
        if self.inlined_saved is not None:
            return sum(b.nbytes for b in self.inlined_saved if b.is_region_input)
        return sum(r.saved_input_bytes for _, r in self.inner)

    @property
    def all_fused_saved(self) -> list:
        """fused_saved, or for a step listing its inlined value_and_grad plans apart (inner
        without inlined_saved), theirs: the values those plans read across that the compiled
        plans compute in the loop reading them. Saved totals leave them out; the planner (and
        memory_frontier's saved column) counts them."""
        if self.inner and self.inlined_saved is None:
            return [f for _, r in self.inner for f in r.fused_saved]
        return list(self.fused_saved)

    @property
    def recomputed_bytes(self) -> int:
        """Bytes rematerialisation keeps out of the saved buffers: the backward recomputes them."""
        return sum(r.nbytes for r in self.recomputed)

    @property
    def compiled_scratch_bytes(self) -> int | None:
        """Scratch the compiled step keeps and reuses across calls: one arena the forward and
        backward() share, the larger plan's size (runtime/program.py), or the joint plan's for
        value_and_grad; None unless the backend is numba."""
        if self.compiled is None:
            return None
        return max(
            (f.scratch_bytes for f in self.compiled if f.plan in STEP_PLANS and f.compiled),
            default=0,
        )

    @property
    def packing_bytes(self) -> int | None:
        """Bytes of backplan's GEMM packing buffers the step's products write: buffers each
        thread running the GEMM keeps for the process's life (one mapping each, shared by every
        compiled function; only written pages resident), the pages the blocked GEMM's rules
        write for these shapes (codegen/kernels/gemm/packing.py; 16-bit, mixed, strided and
        convolution products as if packed whole). Counted in `peak_bytes` (category
        `packing`), which the memory planner, budgets and the checked mode count too; a
        product shared between threads adds its pages once per helper thread, so the figure
        depends on the threads (`packing_threads`). BLAS products, packing in OpenBLAS's own
        buffers, add nothing; None unless the backend is numba."""
        if self.compiled is None:
            return None
        return max((f.packing_bytes for f in self.compiled if f.compiled), default=0)

    @property
    def packing_threads(self) -> tuple[int, int, int] | None:
        """(the calling thread's packing bytes, each helper thread's, helper threads) of the
        plan with the most packing (packing_bytes = first + helpers x each); None unless the
        backend is numba."""
        if self.compiled is None:
            return None
        facts = [f for f in self.compiled if f.compiled]
        if not facts:
            return (0, 0, 0)
        return max(facts, key=lambda f: f.packing_bytes).packing_threads

    @property
    def process_bytes(self) -> int | None:
        """Bytes this process holds for compiled code, beside every step's peak, measured: the
        growth of its resident memory while backplan loaded kernels from the disk cache or
        Numba compiled them, all functions together, so far (read when asked; a first call
        loading this step's kernels adds to it): LLVM's own code that linking touches, the
        kernels' machine code, and what a compile leaves resident
        (codegen/build/process_memory.py). Once a process, never a step's, so not in
        `peak_bytes` and not met by budgets; None unless the backend is numba."""
        if self.compiled is None:
            return None
        return process_memory.code_bytes()

    @property
    def compiled_output_bytes(self) -> int | None:
        """Bytes the compiled forward and backward() (or the joint plan) allocate fresh on every
        call; None unless the backend is numba."""
        return self._compiled_sum("output_bytes")

    @property
    def compiled_reused_output_bytes(self) -> int | None:
        """Bytes of the large outputs (results and saved buffers, 64 KiB or more, none that
        goes back in donated) the compiled plans keep between calls to write the next call's
        into (codegen/run/workspace.py): one generation beside the results a loop holds, so a
        loop that rebinds its results faults in no new pages. Resident between calls, as the
        scratch arenas are; the joint plan's too where a joint step runs. None unless the
        backend is numba."""
        kept = self._compiled_sum("reused_output_bytes")
        joint = self.joint_step_facts
        if kept is not None and joint is not None and joint.compiled:
            kept += joint.reused_output_bytes
        return kept

    @property
    def loop_resident_bytes(self) -> int:
        """The step's own bytes that stay resident between calls of the loop users write
        (`loss, grads = step(params, x)`, `p, s = update(g, s, p)`), the arguments and
        constants aside: the scratch arenas, the results the loop keeps bound
        (kept_output_bytes) and the generation before them the compiled plans keep to write
        the next call's into (compiled_reused_output_bytes); on the reference backend the
        results alone."""
        kept = self.kept_output_bytes(self.call_peaks[-1].first_call)  # the steady loop's
        if self.compiled is None:
            return kept
        scratch = self.compiled_scratch_bytes
        joint = self.joint_step_facts
        if joint is not None and joint.compiled:
            scratch += joint.scratch_bytes
        return scratch + kept + self.compiled_reused_output_bytes

    @functools.cached_property
    def call_peaks(self) -> list[CallPeak]:
        """Which plans run on which call, each with its predicted peak: one entry, or for a
        small compiled loss that backward() follows, two plans on calls 1 and 2 and one joint
        plan from call 3 on (runtime/joint_step.py)."""
        runs = "one joint plan" if "joint" in self.plans else "the forward plan"
        runs = TWO_PLANS if "backward" in self.plans else runs
        first = CallPeak(1, runs, predicted_peak(self.peak_calls, self._peak_backend()))
        if self.joint_step_calls is None:
            return [first]
        plan = self.joint_step_calls[0].plan
        joint = predicted_peak(self.joint_step_calls, self._peak_backend(plan))
        return [first, CallPeak(JOINT_FROM_CALL, ONE_JOINT_PLAN, joint)]

    @functools.cached_property
    def peak(self) -> PeakReport:
        """The step's predicted peak on the backend that runs it, in the loop users write
        (ir/peak.py, report/loop_peak.py): bytes held per category at each kernel (compiled) or
        step (reference), the caller's arrays included and, from the second call, the previous
        call's results its names still hold ("previous outputs"). The call of that loop that
        holds the most (loop_peak_on_call; the later on a tie): no call holds more. A compiled
        plan numba cannot compile runs on the reference interpreter: then the whole step is
        counted that way."""
        return max(
            (self.loop_peak_on_call(n) for n in self._loop_calls()),
            key=lambda p: p.peak_bytes,
        )

    @functools.cached_property
    def call_peak(self) -> PeakReport:
        """The peak of a call whose caller let the last results go first (`step(params, x)`
        alone, or the first call of a loop): where calls run different plans (call_peaks), the
        highest of their peaks (the later on a tie)."""
        return max(self.call_peaks, key=lambda c: (c.peak.peak_bytes, c.first_call)).peak

    @functools.cached_property
    def joint_step_facts(self) -> CompiledPlanFacts | None:
        """The joint plan a joint step runs from call 3 as the numba backend compiles it (its
        arena, kept besides the two plans', and what each call allocates); None without a
        joint step or off numba."""
        if self.joint_step_calls is None or self.compiled is None:
            return None
        return joint_facts(self.joint_step_calls[0].plan)[0]

    @functools.cached_property
    def fallback_peak(self) -> PeakReport | None:
        """A joint step's call back on two plans after the joint plan ran (its loss
        backward()ed from another seed, or never backward()ed): the two plans run, the joint
        plan's arena still held; not part of call_peaks' training loop (retain_graph:
        retain_peak). None without a joint step."""
        if self.fallback_calls is None:
            return None
        return predicted_peak(self.fallback_calls, self.call_peaks[0].peak.backend)

    @functools.cached_property
    def building_peak(self) -> PeakReport | None:
        """bp.compile(..., background=True): what its calls hold while the kernels build, on
        the reference interpreter, the compiled plans' scratch arenas held too (ir/peak.py
        building_peak); where calls run different plans (call_peaks), the highest. None for a
        step compiled otherwise."""
        if not self.background_build:
            return None
        ways = [self.building_peak_on_call(c.first_call) for c in self.call_peaks]
        return max(ways, key=lambda p: p.peak_bytes)

    def building_peak_on_call(self, n: int) -> PeakReport | None:
        """building_peak of the n-th call (from 1): the plans that call runs (call_peaks)."""
        if not self.background_build:
            return None
        joint = self.joint_step_calls is not None and n >= self.call_peaks[-1].first_call
        return building_peak(self.joint_step_calls if joint else self.peak_calls)

    @functools.cached_property
    def retain_peak(self) -> PeakReport | None:
        """A call whose loss is backward()ed with retain_graph=True and then again: the
        forward, the backward that keeps the saved buffers (its own compiled plan and arena),
        then the one that frees them, the first one's gradients held (in .grad) while the
        second runs. Not part of call_peaks' training loop, which backward()s each loss once;
        after a joint plan ran, retain_after_joint_peak. The next call frees that backward
        plan's arena before it runs (RegionProgram.release_retained), so it holds what
        peak_on_call prints. None without a backward."""
        if self.retain_calls is None:
            return None
        return predicted_peak(self.retain_calls, self._peak_backend())

    @functools.cached_property
    def retain_after_joint_peak(self) -> PeakReport | None:
        """retain_peak for such a call after the joint plan ran: its arena held too. None
        without a joint step."""
        if self.retain_calls is None or self.fallback_calls is None:
            return None
        joint_idle = self.fallback_calls[-1:]
        return predicted_peak(self.retain_calls + joint_idle, self.call_peaks[0].peak.backend)

    def peak_on_call(self, n: int) -> PeakReport:
        """The predicted peak of the n-th call (from 1) of this signature, each earlier call's
        loss backward()ed from the default seed (a training loop)."""
        if n < 1:
            raise ValueError(f"peak_on_call({n!r}): calls are counted from 1")
        return [c for c in self.call_peaks if c.first_call <= n][-1].peak

    @property
    def returns_gradients(self) -> bool:
        """value_and_grad's step hands its gradients back; a compiled loss leaves them in .grad."""
        return "joint" in self.plans

    def loop_peak_on_call(self, n: int, kept: int | None = None) -> PeakReport:
        """peak_on_call(n) in a loop that keeps the last outputs until the call returns
        (`loss, grads = step(params, x)`): from call 2 the previous call's results, which the
        caller's names still hold, are counted too (report/loop_peak.py). kept: the bytes of
        those results where the previous call ran another signature or size (its report's
        kept_output_bytes), else this signature's own."""
        peak = self.peak_on_call(n)
        if kept is None:
            kept = self.kept_output_bytes(n - 1) if n > 1 else 0
        elif isinstance(kept, bool) or not isinstance(kept, numbers.Integral) or kept < 0:
            raise TypeError(
                f"loop_peak_on_call: kept is the bytes the previous call's results hold (its "
                f"report's kept_output_bytes(n) for its call number n), got {kept!r}"
            )
        return holding(peak, int(kept))

    def kept_output_bytes(self, n: int) -> int:
        """Bytes of the n-th call's results a loop keeps bound through the next call (what it
        allocated and hands back, less what goes back in as donated arrays)."""
        joint = self.joint_step_calls is not None and n >= self.call_peaks[-1].first_call
        calls = self.joint_step_calls if joint else self.peak_calls
        return kept_output_bytes(calls, self.returns_gradients, self.not_returned)

    @functools.cached_property
    def observed_peak(self) -> PeakReport | None:
        """The peak of the loop this process ran, where a second call of this signature has
        shown what it does with the last results (loop_observed): the bytes that stayed bound
        beside that call are held from the second call on; results passed back in as its
        arguments count once, among the arrays passed in (peak_bytes counts them as kept: an
        upper bound by those bytes). None before a second call."""
        seen = self.loop_observed
        if seen is None:
            return None
        return max(
            (self.loop_peak_on_call(n, kept=seen.kept if n > 1 else 0) for n in self._loop_calls()),
            key=lambda p: p.peak_bytes,
        )

    @property
    def observed_peak_bytes(self) -> int | None:
        """observed_peak's bytes; None before a second call of this signature."""
        peak = self.observed_peak
        return None if peak is None else peak.peak_bytes

    def _loop_calls(self) -> list[int]:
        """The calls whose peaks stand for every call of a loop: each first call of a plan
        change (call_peaks) and the one after it, which also holds the last results."""
        calls = {1, 2} | {n for c in self.call_peaks for n in (c.first_call, c.first_call + 1)}
        return sorted(calls)

    @property
    def loop_peak_bytes(self) -> int:
        """peak_bytes (the peak is the loop's): kept as the name the loop figure had."""
        return self.peak_bytes

    @property
    def call_peak_bytes(self) -> int:
        """The most one call holds whose caller let the last results go first: peak_bytes less
        the previous call's results where the loop's peak holds them (call_peak)."""
        return self.call_peak.peak_bytes

    def _peak_backend(self, joint_plan: Plan | None = None) -> str:
        backend = self.backend
        facts = self.compiled if joint_plan is None else None
        if backend == "numba" and joint_plan is not None:
            facts = [self.joint_step_facts or joint_facts(joint_plan)[0]]
        if facts is not None and any(not f.compiled for f in facts):
            backend = "reference"
        return backend

    @property
    def peak_bytes(self) -> int:
        """The most bytes the step holds at any point of the loop users write, on the backend
        that runs it: the arrays you pass in, parameters, donated buffers, scratch arenas,
        outputs, saved buffers, gradients and, from the second call, the previous call's
        results that `loss, grads = step(params, x)` keeps bound until the call returns
        (`peak.at_peak()` splits it by category). Every result counts as kept but those
        written into donated arguments: exact for such loops and `new = step(params, x)`, an
        upper bound by the bytes passed back for `params = step(params, x)` without donation
        (observed_peak_bytes: what this process's loop held, once it ran a second call).
        Budgets (max_peak_bytes), memory_frontier, bp.max_batch and fits() bound this figure;
        call_peak_bytes is one call's alone."""
        return self.peak.peak_bytes

    @functools.cached_property
    def frontier(self) -> MemoryFrontier | None:
        """The plans a memory budget chooses from (fn.memory_frontier(...)): peak bytes against
        the FLOPs each adds by recomputing, the default plan first; None for a report made
        without its planner (a loaded artifact's). Planned for the report's backend, whichever
        is current when it is first read (printing a numba report under the reference
        interpreter listed the reference interpreter's peaks beside numba's peak line)."""
        if self.frontier_source is None:
            return None
        if current_backend() == self.backend:
            return self.frontier_source()
        with backend_in_this_thread(self.backend):  # other threads' steps keep theirs
            return self.frontier_source()

    def fits(self, nbytes: int) -> bool:
        """Whether the step's predicted peak in a loop (peak_bytes) is at most nbytes."""
        return self.peak.fits(nbytes)

    @property
    def live_bytes(self) -> list[int]:
        """Bytes held at each IR step on the reference interpreter (forward steps, then
        backward steps), the caller's own arrays not counted."""
        return self.view.live_bytes()

    @property
    def reference_peak_bytes(self) -> int:
        """The most of `live_bytes`: the reference interpreter's peak, your arrays left out."""
        return max(self.live_bytes, default=0)

    @property
    def forward_peak_bytes(self) -> int:
        """The most of `live_bytes` during the forward."""
        return self._phase_peak("forward")

    @property
    def backward_peak_bytes(self) -> int:
        return self._phase_peak("backward")

    @property
    def reference_peak_step(self) -> StepInfo | None:
        live = self.live_bytes
        return self.view.steps[live.index(max(live))] if live else None

    @property
    def input_bytes(self) -> int:
        """Bytes of the arrays passed in, held by the caller and not counted in the peaks."""
        return sum(b.nbytes for b in self.view.buffers.values() if b.kind == "input")

    @property
    def n_forward_steps(self) -> int:
        return self.view.n_forward

    @property
    def n_backward_steps(self) -> int:
        return self.view.n_backward

    @property
    def fused_kernels(self) -> int:
        """Kernels that run several IR steps as one."""
        return sum(1 for k in self.kernels if k.fused and k.runs_code)

    @property
    def n_kernels(self) -> int:
        """Kernel calls the plans make (views, aliases, literals and loops whose values are
        all recomputed where read cost none; a long sum of arrays runs as several)."""
        return sum(k.calls for k in self.kernels if k.runs_code)

    def _compiled_sum(self, name: str) -> int | None:
        if self.compiled is None:
            return None
        return sum(getattr(f, name) for f in self.compiled if f.plan in STEP_PLANS and f.compiled)

    def _phase_peak(self, phase: str) -> int:
        live = self.live_bytes
        return max((live[s.index] for s in self.view.steps if s.phase == phase), default=0)

    # ---- renderings ---------------------------------------------------------------------------

    def __str__(self) -> str:
        from .text import render_report

        return render_report(self)

    def to_dot(self) -> str:
        """Graphviz DOT of the forward and backward graphs, saved buffers as their own nodes."""
        from .dot import report_dot

        return report_dot(self)

    def save_dot(self, path) -> None:
        with open(path, "w", encoding="utf-8") as file:
            file.write(self.to_dot())

    def save_trace(self, path, times: list[float] | None = None) -> None:
        """Write the step as Chrome trace / Perfetto JSON: a track of kernels in the predicted
        order (measured seconds per kernel when `times` gives them) and counters of the bytes
        held per category (`peak`). Open it in ui.perfetto.dev or chrome://tracing."""
        from .trace_file import save_trace

        save_trace(self._traced_peak(times), path, times)

    def _traced_peak(self, times) -> PeakReport:
        """The peak whose steps `times` measured: fn.profile times calls of a loop from its
        fourth on, which may run other plans than the call explain's peak is at (a compiled
        loss with backward(): two plans on calls 1-2, one joint plan from call 3). Then the
        latest loop call running as many kernels; else the peak (save_trace says the counts)."""
        count = len(getattr(times, "seconds", ()))
        if not count or count == len(self.peak.steps):
            return self.peak
        for n in reversed(self._loop_calls()):
            peak = self.loop_peak_on_call(n)
            if len(peak.steps) == count:
                return peak
        return self.peak

    def plot(self, path, max_buffers: int = 60) -> None:
        """Write the memory timeline as PNG or SVG (by the file's suffix). Needs matplotlib:
        `pip install backplan[plot]`."""
        from .plot import plot_report

        plot_report(self, path, max_buffers=max_buffers)


def region_report(
    program: RegionProgram, traces: int = 1, retrace_reason: str | None = None, kernel_groups=None
) -> ExplainReport:
    """The report of a compiled function's region program. kernel_groups: see kernels.py; by
    default, the groups of the backend the program runs on."""
    plans = program.plans
    view = region_view(program)
    if getattr(plans, "inlined_forward", None) is not None:
        mark_held(view, plans.forward, plans.inlined_forward)
    named = plans.named
    backend = program.backend or current_backend()
    compiled = region_facts(program) if backend == "numba" else None
    if kernel_groups is None:
        kernel_groups = planned_groups(_compiled_plans(named, compiled), backend)
    inlined, fused = _split_fused(_inlined_saved(program, _stored(plans.forward, compiled)))
    if inlined is not None and backend == "reference":  # its widened plan's float32 values
        inlined = widened_inlined_info(plans.forward, plans, inlined)
    return ExplainReport(
        program.name,
        view,
        named,
        list(program.saved_info),
        kernels_from_groups(view, kernel_groups),
        traces,
        retrace_reason,
        list(plans.wrt),
        backend,
        recomputed_infos(program),
        compiled,
        plans.peak_calls(),
        joint_step=program.joint_step is not None,
        joint_step_calls=_joint_step_calls(program),
        fallback_calls=_fallback_calls(program),
        retain_calls=_retain_calls(program),
        inlined_saved=inlined,
        update_order=getattr(plans, "update_order", None),
        fused_saved=fused,
        kept_float32=kept_float32(view, named),
    )


def _joint_step_calls(program: RegionProgram) -> list | None:
    """The joint plan a small compiled loss runs once backward() follows its calls (built
    here if no call has run it yet: planning only, nothing compiles). The forward and
    backward that ran the first calls stay compiled, idle, holding their constants: they
    free their arenas when it takes over (JointStep.run)."""
    step = program.joint_step
    if step is None:
        return None
    kept = [
        dataclasses.replace(c, idle=True, keeps_arena=False) for c in program.plans.peak_calls()
    ]
    return joint_calls(step.plan(), program.plans.n_outputs) + kept


def _fallback_calls(program: RegionProgram) -> list | None:
    """The forward and backward run again after the joint plan ran, which stays compiled."""
    step = program.joint_step
    if step is None:
        return None
    idle = dataclasses.replace(joint_calls(step.plan(), program.plans.n_outputs)[0], idle=True)
    return [*program.plans.peak_calls(), idle]


def _retain_calls(program: RegionProgram) -> list | None:
    """The forward, backward(retain_graph=True)'s plan, then backward()'s."""
    plans = program.plans
    if getattr(plans, "backward", None) is None:
        return None
    forward, kept = plans.peak_calls(consume=False)
    again = plans.peak_calls(consume=True)[1]
    return [forward, dataclasses.replace(kept, label="backward(retain_graph=True)"), again]


def _inlined_saved(program: RegionProgram, stored: set | None) -> list | None:
    forward = getattr(program.plans, "inlined_forward", None)
    if forward is None:
        return None
    return inlined_saved_info(program.plans.forward, forward, program.input_names, stored)


def _stored(plan: Plan, compiled: list[CompiledPlanFacts] | None) -> set | None:
    """The values of plan the numba backend keeps in a buffer (ir/lowering.py stored_values);
    None on the reference interpreter (every value its own buffer), also where the plan runs
    there because numba cannot compile it."""
    if compiled is None or not all(f.compiled for f in compiled):
        return None
    return stored_values(lower(plan))


def _split_fused(infos: list | None) -> tuple[list | None, list]:
    """(the rows the plan stores, renumbered; the rows fusion keeps out of memory)."""
    if infos is None:
        return None, []
    kept = [i for i in infos if not i.fused]
    return [dataclasses.replace(i, slot=n) for n, i in enumerate(kept)], [
        i for i in infos if i.fused
    ]


def joint_report(
    plan: Plan,
    n_outputs: int,
    wrt: list[bool],
    input_names: list[str] | None,
    name: str,
    traces: int = 1,
    retrace_reason: str | None = None,
    kernel_groups=None,
    backend: str | None = None,
) -> ExplainReport:
    """The report of value_and_grad's joint plan (outputs: loss, aux, then gradients)."""
    view = joint_view(plan, n_outputs, wrt, input_names, name)
    plans = JointPlans(plan, n_outputs, list(wrt))
    backend = backend or current_backend()
    compiled = joint_facts(plan) if backend == "numba" else None
    if kernel_groups is None:
        kernel_groups = planned_groups(_compiled_plans(plans.named, compiled), backend)
    saved, fused = _split_fused(joint_saved_info(plan, view, _stored(plan, compiled)))
    if backend == "reference":  # the widened plan it runs holds float32 values across too
        saved = widened_saved_info(plan, n_outputs, view, saved)
    return ExplainReport(
        name,
        view,
        plans.named,
        saved,
        kernels_from_groups(view, kernel_groups),
        traces,
        retrace_reason,
        list(wrt),
        backend,
        compiled=compiled,
        peak_calls=plans.peak_calls(),
        fused_saved=fused,
        kept_float32=kept_float32(view, plans.named),
    )


def _compiled_plans(named: dict[str, Plan], compiled) -> dict[str, Plan]:
    """The plans the numba backend compiles; one it cannot compile runs on the reference
    interpreter, one kernel per step."""
    if compiled is None:
        return named
    refused = {f.plan.split(" ")[0] for f in compiled if not f.compiled}
    return {name: plan for name, plan in named.items() if name not in refused}
