"""A memory budget met or refused before anything compiles: `bp.compile(fn, max_peak_bytes=N)`,
`bp.value_and_grad(fn, max_peak_bytes=N)`, and `saved_bytes_budget`, its older form.

The planner (ir/budget.py) lists plans from the default one to the smallest peak it reaches;
each is built and its peak taken from `step_peak_bytes`, the one function that says what a step
holds. The cheapest plan (fewest added FLOPs) that fits is used; if none fits,
`MemoryBudgetError` says the smallest peak reachable, what it costs and the ways out.
"""

from __future__ import annotations

import numbers
from contextlib import contextmanager
from dataclasses import dataclass, replace

from backplan.ir.budget import PlanPoint, plan_frontier, refined_within
from backplan.ir.errors import MemoryBudgetError
from backplan.ir.flops import node_flops
from backplan.ir.gc_pause import paused_gc
from backplan.ir.peak import (
    argument_copy_bytes,
    predicted_peak,
    predicted_peak_bytes,
    with_argument_copies,
)
from backplan.ir.pipeline import PlanChoices
from backplan.ir.plans import StepPlans
from backplan.ir.types import is_half, np_dtype
from backplan.report.frontier import FrontierPoint, MemoryFrontier
from backplan.report.fused_saved import fused_held_bytes
from backplan.report.loop_peak import holding, kept_output_bytes
from backplan.report.peak_holders import peak_holders
from backplan.report.widened_saved import widened_held_bytes
from backplan.report.wording import format_bytes
from backplan.runtime.backend import current_backend

from .built_descent import built_descent
from .source import loc_text, user_frame_loc


def checked_budget(value, option: str) -> int | None:
    """None, or a positive int (NumPy's integers too, as a computed byte count often is):
    anything else is refused with what was given."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{option} must be a positive int (bytes), got {value!r}")
    if value <= 0:
        raise ValueError(f"{option} must be a positive number of bytes, got {value}")
    return int(value)


def step_peak_bytes(
    plans: StepPlans, not_kept=frozenset(), kept: int | None = None, numpy=frozenset()
) -> int:
    """The highest number of bytes the step holds on the current backend in the loop users
    write, the arrays passed in included (ir/peak.py: arenas, outputs, saved buffers and
    gradients of the compiled plans, or every IR value its own buffer on the reference
    interpreter), and from the second call the previous call's results the caller's names
    still hold (report/loop_peak.py): what explain's peak_bytes prints. Outputs written into
    donated inputs are not allocated by the step, as explain() counts them. not_kept: outputs
    of the first plan a loop does not keep (BudgetPlanner.not_kept). kept: those results'
    bytes when already known (BudgetPlanner.kept_bytes: the same for every plan of a
    signature), so each plan weighed does not walk its whole graph for them again. numpy:
    inputs passed as NumPy arrays, each copied at the call where the plan's backward reads it
    (tracer/numpy_args.py; BudgetPlanner.numpy_inputs)."""
    calls, backend = _step_calls(plans, numpy)
    if kept is None:
        kept = _kept(plans, calls, not_kept)
    return predicted_peak_bytes(calls, backend, kept)


def _kept(plans: StepPlans, calls: list, not_kept=frozenset()) -> int:
    """Bytes of one call's results a loop keeps through the next call (kept_output_bytes):
    value_and_grad hands back its gradients, a compiled function its outputs."""
    return kept_output_bytes(calls, "joint" in plans.named, not_kept)


def _step_calls(plans: StepPlans, numpy=frozenset()) -> tuple[list, str]:
    """(the plan calls of one step, the backend they are accounted on); the inputs of numpy
    its backward reads are copies the step holds (ir/peak.py with_argument_copies)."""
    backend = "reference" if current_backend() == "reference" else "numba"
    calls = plans.peak_calls()
    saved = getattr(plans, "saved", None) if numpy else None
    if saved and getattr(plans, "backward", None) is not None:
        read = frozenset(s.source[1] for s in saved if s.source[0] == "input")
        calls = with_argument_copies(calls, numpy & read)
    return calls, backend


def _copied_bytes(plans: StepPlans, numpy: frozenset) -> int:
    """Bytes of the copies of NumPy arguments the plans' backward reads (_step_calls)."""
    if getattr(plans, "backward", None) is None or not getattr(plans, "saved", None):
        return 0
    inputs = plans.forward.graph.inputs
    read = {s.source[1] for s in plans.saved if s.source[0] == "input"}
    return sum(inputs[i].type.nbytes for i in read & numpy)


def holders_text(plans: StepPlans, not_kept=frozenset(), numpy=frozenset()) -> str:
    """What holds the step at its peak, from the same accounting as step_peak_bytes."""
    calls, backend = _step_calls(plans, numpy)
    peak = holding(predicted_peak(calls, backend), _kept(plans, calls, not_kept))
    return peak_holders(peak, calls)


@dataclass(frozen=True)
class EvaluatedPoint:
    """A plan of the frontier, built: its step peak, held bytes and the FLOPs it adds."""

    peak_bytes: int
    saved_bytes: int
    added_flops: int
    recomputed: int  # held values recomputed instead, beyond the default plan's
    drop: frozenset
    plans: object
    saved_dtype: str | None = None  # the saved buffers' narrower dtype (allow_saved_dtype)
    # of saved_bytes, those the compiled plan computes in the loop reading them, never stored
    # (numba; report/fused_saved.py): the frontier's saved column leaves them out
    fused: int = 0
    # what the step also holds for its gradients: float32 values the reference interpreter
    # holds for a 16-bit plan (report/widened_saved.py), copies of NumPy arguments the
    # backward reads (tracer/numpy_args.py); the frontier's saved column adds them
    more_saved: int = 0


@dataclass(frozen=True)
class SavedLink:
    """A plan of saved_bytes_budget's chain: its saved bytes (as the budget counts them), its
    step peak, the plans, and the frontier point and narrowing it comes from (None: default)."""

    saved: int
    peak: int
    plans: object
    point: PlanPoint | None = None
    narrowed: bool = False


class BudgetPlanner:
    """The choices of one traced signature and what its plans weigh. allow_dtype (a 16-bit
    float, `allow_saved_dtype=`): a budget may also be met by keeping the saved buffers the
    forward computes in that dtype, a plan that adds no FLOPs (one cast each way) and rounds
    what the backward reads; at equal added FLOPs the full-precision plan is preferred."""

    def __init__(
        self,
        choices: PlanChoices,
        input_bytes: int,
        name: str,
        allow_dtype: str | None = None,
    ):
        self.choices, self.input_bytes, self.name = choices, input_bytes, name
        self.inlined: list[str] = []  # where value_and_grad plans were inlined (their lines)
        self.allow_dtype = allow_dtype
        self._narrow_choices = _narrowing(choices, allow_dtype) if allow_dtype else None
        self.narrowed_for: str | None = None  # the budget the narrowed plans were chosen for
        self._built: dict[tuple, EvaluatedPoint] = {}
        self._points: dict[tuple, list] = {}
        self.recomputed_for: tuple | None = None  # (budget words, point chosen, narrowed)
        self._chain: list[SavedLink] | None = None  # saved_chain, built once
        self._full_chain: list[SavedLink] | None = None  # its full-precision twin (allow_dtype)
        # outputs a loop does not keep as the last results: those the function drops (bp.grad's
        # value); every other result counts as kept (report/loop_peak.py states it)
        self.not_kept: frozenset = frozenset()
        # inputs the call it was planned for passed as NumPy arrays: a plan whose backward
        # reads one holds a copy of it (tracer/numpy_args.py), counted in its peak
        self.numpy_inputs: frozenset = frozenset()
        self._kept: int | None = None  # kept_bytes, worked out once
        self.fitted: tuple[str, int] | None = None  # (the budget option met, its bytes)
        self._offer: str | None = None  # narrowing_offer's words, worked out once
        self._half: bool | None = None  # _has_half, worked out once

    def build(self, drop: frozenset = frozenset(), narrowed: bool = False):
        return (self._narrow_choices if narrowed else self.choices).build(drop)

    def evaluate(self, point, narrowed: bool = False, plans: bool = True) -> EvaluatedPoint:
        """point's plan built and its step peak taken, once. plans=False: its peak and costs
        suffice, so a plan whose plans memory_frontier let go (forget_plans) is not built again."""
        key = (point.drop, narrowed)
        if key not in self._built:
            # the default plan is built anyway (its choices keep it: PlanChoices.build)
            simulated = point.drop and not (plans or narrowed)
            peak = self.analytic_peak(point.drop) if simulated else None
            built = None
            if peak is None:
                with paused_gc():  # ir/gc_pause.py: full collections walk every plan built
                    built = self.build(point.drop, narrowed)
                    peak = step_peak_bytes(
                        built, self.not_kept, self.kept_bytes(), self.numpy_inputs
                    )
            dtype = self.allow_dtype if narrowed else None
            held = self._narrowed_held(point, built) if narrowed else point.held_bytes
            fused = more = 0
            if built is not None and current_backend() != "reference":
                fused = fused_held_bytes(built)
            elif built is not None:  # the interpreter's widened plan holds float32 values too
                more = widened_held_bytes(built)
            if built is not None and self.numpy_inputs:
                more += _copied_bytes(built, self.numpy_inputs)
            self._built[key] = EvaluatedPoint(
                peak,
                held,
                point.added_flops,
                len(point.drop),
                point.drop,
                built,
                dtype,
                fused,
                more,
            )
        evaluated = self._built[key]
        return self.with_plans(evaluated) if plans else evaluated

    def analytic_peak(self, drop: frozenset) -> int | None:
        """drop's step peak without building its plan, where the step schedule's simulation
        is that peak to the byte (tests/test_analytic_peak.py): the reference interpreter
        running one plan (value_and_grad's joint plan, or a compiled step whose gradients are
        inlined), its saved values as computed. Then a row of memory_frontier, or a candidate
        a budget passes over, costs a simulation (ms) instead of a plan build. None elsewhere:
        compiled plans fuse loops and place buffers in an arena (ir/peak.py), which the
        simulation does not model, and a forward and a backward plan also hold the
        cotangents backward() passes in. None too for a step with 16-bit values: the
        interpreter runs its plan widened, float32 values held from the step computing them
        to the op that rounds them (ir/peak.py `_as_interpreted`), which the schedule,
        walking the plan before widening, does not model."""
        schedule = self.choices.schedule
        if (
            current_backend() != "reference"
            or self._has_half()
            or schedule.two_plans
            or self.choices.options.saved_dtype is not None
            or not self.choices.differentiated
        ):
            return None
        # one plan holds a loop's last results throughout (report/loop_peak.py holding)
        return schedule.simulate(drop).peak + self.input_bytes + self.kept_bytes()

    def _has_half(self) -> bool:
        """Whether a value of the traced step is a 16-bit float (asked once)."""
        if self._half is None:
            self._half = any(is_half(v.type.dtype) for v in self.choices.schedule.values)
        return self._half

    def with_plans(self, evaluated: EvaluatedPoint) -> EvaluatedPoint:
        """evaluated with its plans, built again if memory_frontier let them go: the same plans
        (building is deterministic: every row's kernels, buffers and offsets hash equal), so
        the peak found for them still holds."""
        if evaluated.plans is not None:
            return evaluated
        key = (evaluated.drop, evaluated.saved_dtype is not None)
        with paused_gc():
            plans = self.build(*key)
        self._built[key] = evaluated = replace(evaluated, plans=plans)
        return evaluated

    def forget_plans(self, keys) -> None:
        """Keep only the peaks and costs of these evaluated plans: memory_frontier builds and
        lowers every row to read its peak, and a 10,086-node plan's rows kept 185 MiB and
        1.1 M objects the collector walks alive for as long as the function lived. A default
        plan (nothing recomputed) is kept: its choices keep it anyway (PlanChoices.build)."""
        for drop, narrowed in keys:
            if drop:
                self._built[drop, narrowed] = replace(self._built[drop, narrowed], plans=None)

    def _narrowed_held(self, point, plans=None) -> int:
        """The bytes point's plan holds from forward to backward with its saved buffers in
        allow_dtype: each float value it holds (the user's outputs excepted) at the narrower
        itemsize, as ir/saved_dtype.py stores them; with its plans built, the values they
        left in full precision (ir/pipeline.py narrowed_for_peak) at their own."""
        narrowing = getattr(plans, "narrowing", None)
        left_wide = 0 if narrowing is None else narrowing.left_wide_bytes
        schedule, narrow = self.choices.schedule, np_dtype(self.allow_dtype).itemsize
        total = 0
        for i in schedule.held:
            if i in point.drop:
                continue
            value, nbytes = schedule.values[i], schedule.held_nbytes[i]
            wide = np_dtype(value.dtype)
            if wide.kind == "f" and wide.itemsize > narrow and i not in schedule.outputs:
                nbytes = nbytes * narrow // wide.itemsize
            total += nbytes
        return total + left_wide

    def candidates(self, points: list) -> list[tuple]:
        """(point, narrowed) in the order a budget tries them: fewest added FLOPs first, at
        equal FLOPs full precision first (narrowed plans only with allow_dtype)."""
        tried = [(p, False) for p in points]
        if self.allow_dtype is not None:
            tried += [(p, True) for p in points]
        return sorted(tried, key=lambda c: (c[0].added_flops, c[1]))

    def note(self) -> str:
        """What explain's summary says about the planner's choice: the saved buffers' dtype,
        and what a budget made a step with inlined gradients recompute."""
        return " ".join(t for t in (self.saved_dtype_note(), self._recomputed_note()) if t)

    def _recomputed_note(self) -> str:
        """Under a budget the step holds fewer values than the default plan: which plan it runs
        instead and what that costs (section 3 of a step with inlined gradients lists its
        value_and_grad's own saved buffers; a value_and_grad's lists those of the plan that
        runs, but nowhere else says what the budget added), and, where the budget was met by
        recomputing in full precision, what bfloat16 saved buffers would cost instead."""
        if self.recomputed_for is None:
            return ""
        budget, point, narrowed = self.recomputed_for
        held = self.evaluate(point, narrowed, plans=False).saved_bytes
        # as the frontier's saved column: on numba the compiled plans' (fused values unstored)
        held -= self.evaluate(point, narrowed, plans=False).fused
        total = self.choices.schedule.held_bytes() - self.evaluate_default(plans=False).fused
        step = max(self.step_flops(), 1)
        readers = (
            "its inlined gradients read" if self.choices.inlined_gradients else "its backward reads"
        )
        return (
            f"To fit {budget}, the step recomputes {len(point.drop)} of the values {readers} "
            f"instead of holding them: it holds {format_bytes(held)} "
            f"of them (of {format_bytes(total)}) for "
            f"{point.added_flops:,} added FLOPs (+{100 * point.added_flops / step:.1f}% of the "
            "step)." + self.narrowing_offer()
        )

    def narrowing_offer(self, dtype: str = "bf16") -> str:
        """A budget met by recomputing in full precision, no narrower saved dtype allowed: what
        allow_saved_dtype=bp.bfloat16 would run for the same budget, when it adds fewer FLOPs
        (worked out once, when explain asks: a second planner sharing this one's built plans
        weighs the narrowed candidates, as a budget allowed them would)."""
        if (
            self.recomputed_for is None
            or self.fitted is None
            or self.allow_dtype is not None
            or self.choices.options.saved_dtype is not None
        ):
            return ""
        if self._offer is None:
            self._offer = self._narrowed_alternative(dtype)
        return self._offer

    def _narrowed_alternative(self, dtype: str) -> str:
        option, limit = self.fitted
        point = self._narrowed_fit(option, limit, dtype)
        if point is None:
            return ""
        _, mine, _ = self.recomputed_for
        if (point.added_flops if point else 0) >= mine.added_flops:
            return ""
        words = self._offer_words(point, dtype)
        return f" allow_saved_dtype=bp.{np_dtype(dtype).name} would fit it {words}."

    def for_numpy_inputs(self, numpy: frozenset) -> BudgetPlanner:
        """This planner for a call passing the inputs `numpy` as NumPy arrays: itself when
        they are the ones it was made for, else a sibling weighing the same choices with each
        copy the backward reads counted (its plans built again: their peaks differ), made once
        per set. A function without a budget runs the same plans whatever kind a call passes;
        its frontier and explain's follow the call's kinds."""
        if numpy == self.numpy_inputs:
            return self
        siblings = self.__dict__.setdefault("_siblings", {})
        other = siblings.get(numpy)
        if other is None:
            other = BudgetPlanner(self.choices, self.input_bytes, self.name, self.allow_dtype)
            other.inlined, other.not_kept = self.inlined, self.not_kept
            other.numpy_inputs = numpy
            siblings[numpy] = other
        return other

    def _narrowed_fit(self, option: str, limit: int, dtype: str):
        """The point a budget allowed dtype for its saved buffers runs (False: nothing
        recomputed), or None where it is refused or keeps full precision. A second planner
        sharing this one's built plans weighs the candidates; the plans it builds are let go."""
        other = BudgetPlanner(self.choices, self.input_bytes, self.name, dtype)
        other.inlined, other.not_kept, other._kept = self.inlined, self.not_kept, self.kept_bytes()
        other.numpy_inputs = self.numpy_inputs
        other._built = self._built  # the same plans (keys say whether narrowed): none rebuilt
        before = set(self._built)
        try:
            if option == "max_peak_bytes":
                other.fit_peak(limit)
            else:
                other.fit_saved(limit, self.build())
        except MemoryBudgetError:
            return None
        finally:  # their peaks were all it needed (a narrowed default plan too: no choices
            for key in set(self._built) - before:  # keep it)
                self._built[key] = replace(self._built[key], plans=None)
        if other.narrowed_for is None:
            return None  # full precision is the cheapest fit with the narrower dtype allowed too
        return other.recomputed_for[1] if other.recomputed_for else False

    def _offer_words(self, point, dtype: str) -> str:
        step = max(self.step_flops(), 1)
        name = np_dtype(dtype).name
        cost = (
            f"for {point.added_flops:,} added FLOPs (+{100 * point.added_flops / step:.1f}%, "
            f"{len(point.drop)} recomputed)"
            if point
            else "with no added FLOPs (nothing recomputed)"
        )
        return (
            f"{cost}, the saved buffers kept in {name}: the backward would read them "
            f"{_rounding_words(dtype)}"
        )

    def chosen(self) -> tuple[frozenset, str | None, str | None]:
        """(the held values the plans run recompute beyond the default, the dtype their
        saved buffers are kept in, the option that chose them, in words)."""
        forced = self.choices.options.saved_dtype
        dtype = forced or (self.allow_dtype if self.narrowed_for else None)
        words = f"saved_dtype={np_dtype(forced).name}" if forced else self.narrowed_for
        if self.recomputed_for is None:
            return frozenset(), dtype, words
        return self.recomputed_for[1].drop, dtype, self.recomputed_for[0]

    def inner_choices(self, joints: list[PlanChoices]):
        """A step with inlined gradients whose plans recompute or narrow held values: the
        same choice for each inlined joint plan, as (drops, dtype, words), one drop per joint
        (ids of its schedule). The step's held values are the joint plans' in order (the
        step inlines their graphs); matched by op, type and line, else None."""
        drop, dtype, words = self.chosen()
        if not self.choices.inlined_gradients or (not drop and dtype is None):
            return None
        step = self.choices.schedule
        held = [i for c in joints for i in c.schedule.held]
        owner = [k for k, c in enumerate(joints) for _ in c.schedule.held]
        schedules = [c.schedule for c in joints]
        if [_held_key(step, i) for i in step.held] != [
            _held_key(schedules[k], i) for k, i in zip(owner, held, strict=True)
        ]:
            return None
        drops: list[set] = [set() for _ in joints]
        for position, i in enumerate(step.held):
            if i in drop:
                drops[owner[position]].add(held[position])
        return [frozenset(d) for d in drops], dtype, words

    def saved_dtype_note(self) -> str:
        """What explain says about the dtype of the saved buffers the forward computes."""
        forced = self.choices.options.saved_dtype
        dtype = forced or (self.allow_dtype if self.narrowed_for else None)
        if dtype is None:
            if self.allow_dtype is None:
                return ""
            return (
                f"allow_saved_dtype={np_dtype(self.allow_dtype).name}: the plan fits its budget "
                "(or has none) with its saved buffers in full precision, so they are kept so."
            )
        why = (
            "saved_dtype"
            if forced
            else (f"allow_saved_dtype: the memory planner chose it to fit {self.narrowed_for}")
        )
        name = np_dtype(dtype).name
        narrowing = self._narrowing()
        if narrowing is not None and not narrowing.narrowed:
            mine, theirs = self._narrowing_peaks(narrowing)
            return (
                f"{why}={name}: the values the gradient part reads stay in full precision: "
                f"kept in {name}, the compiled plans would peak {theirs - mine:,} B higher "
                f"({100 * (theirs - mine) / max(mine, 1):.1f}%): what the narrowing adds "
                "(the copies the backward widens them into, the loops its casts split, the values "
                f"computed inside the loops that read them, never stored, that {name} copies "
                "would store, bp.compile's forward arena held through backward()) outweighs "
                "what the narrow copies save."
            )
        return (
            f"The saved buffers the forward computes are kept in {name} "
            f"({why}): no added FLOPs (one cast each way), and the backward reads them "
            f"{_rounding_words(dtype)}.{self._partly(narrowing)}"
            f"{self._above_full_precision(forced)}"
        )

    def _narrowing_peaks(self, narrowing) -> tuple[int, int]:
        """(the peak of the plans that run, the one the narrowed plans would reach), both
        counted as step_peak_bytes counts (the previous call's results held, and the copies
        of NumPy arguments the backward reads)."""
        kept = self.kept_bytes()
        if narrowing.alternative is None:  # one plan: its results are held throughout
            return narrowing.full_peak + kept, narrowing.narrowed_peak + kept
        mine = self.evaluate_default(plans=False).peak_bytes
        alternative = narrowing.alternative
        return mine, step_peak_bytes(alternative, self.not_kept, kept, self.numpy_inputs)

    def _narrowing(self):
        """What saved_dtype narrowed in the plans that run (ir/saved_dtype.py HeldNarrowing;
        None: every value it holds, or a plan with a backward of its own)."""
        drop = self.recomputed_for[1].drop if self.recomputed_for else frozenset()
        narrowed = self.recomputed_for[2] if self.recomputed_for else bool(self.narrowed_for)
        evaluated = self._built.get((drop, narrowed))
        plans = evaluated.plans if evaluated is not None else None
        if plans is None:
            with paused_gc():
                plans = self.build(drop, narrowed)
        return getattr(plans, "narrowing", None)

    @staticmethod
    def _partly(narrowing) -> str:
        if narrowing is None or narrowing.narrowed == narrowing.offered:
            return ""
        name = np_dtype(narrowing.dtype).name
        left = narrowing.offered - narrowing.narrowed
        return (
            f" {left} of the {narrowing.offered} values the gradient part reads stay in full "
            "precision: the compiled plan computes them inside the loop that reads them, never "
            f"storing them (a {name} copy would be a buffer where there is none)."
        )

    def _above_full_precision(self, forced: str | None) -> str:
        """With saved_dtype given: where its plan peaks above the same plan in full
        precision (a float64 step's copies read back through widened copies: the mixed GEMMs
        read 16-bit copies beside float32 only; or bp.compile's two plans, whose forward
        keeps the full-width activations in its arena through backward()), the two peaks
        and the way out."""
        if forced is None:
            return ""
        options = replace(self.choices.options, saved_dtype=None)
        full_choices = replace(self.choices, options=options, _default=None)
        with paused_gc():
            full = step_peak_bytes(
                full_choices.build(), self.not_kept, self.kept_bytes(), self.numpy_inputs
            )
        mine = self.evaluate_default().peak_bytes
        if mine <= full:
            return ""
        name = np_dtype(forced).name
        return (
            f" That plan peaks at {format_bytes(mine)}, above {format_bytes(full)} with the "
            "saved buffers in full precision: the full-width values held beside the narrow "
            "copies (the copies the backward widens them into, or the forward's arena kept "
            "through backward()) add to what is held. Drop saved_dtype, or give "
            f"allow_saved_dtype=bp.{name} "
            "with max_peak_bytes, which keeps full precision where that peaks lower."
        )

    def points(self, objective: str = "peak") -> list:
        if not self.choices.differentiated:
            return []  # nothing is differentiated: nothing is held for a backward
        compiled = current_backend() != "reference"
        key = (objective, compiled)
        if key not in self._points:
            schedule = self.choices.schedule
            points = plan_frontier(schedule, objective, compiled)
            if objective == "peak" and compiled and schedule.two_plans:
                points = _with_saved_chain(points, self.points("saved"))
                points = points + built_descent(self, points)
            self._points[key] = points
        return self._points[key]

    def cheapest_saved(self, limit: int) -> EvaluatedPoint | None:
        """The cheapest plan whose held bytes (as the schedule counts them, a joint plan's
        too) fit limit, narrowed saved buffers among the candidates with allow_dtype."""
        for point, narrowed in self.candidates(self.points_for(limit, "saved")):
            held = self._narrowed_held(point) if narrowed else point.held_bytes
            if held <= limit:
                evaluated = self.evaluate(point, narrowed)
                if evaluated.saved_bytes <= limit:  # a built plan may narrow less
                    return evaluated
        return None

    def points_for(self, limit: int, objective: str = "peak") -> list:
        """The frontier's points, and a finer plan where the frontier's batches overshoot
        limit (ir/budget.py refined_within): the budget may pick a plan between two rows.
        With allow_dtype, also one refined for the narrowed saved bytes (saved_bytes_budget)."""
        points = self.points(objective)
        if not points:
            return points
        compiled = current_backend() != "reference"
        built = None
        if compiled and objective == "peak":  # judged by built peaks (refined_within)
            limits, built = [limit], lambda p: self.evaluate(p, plans=False).peak_bytes
        else:
            limits = [limit] if objective == "saved" else self._simulated_limits(limit)
        if self.allow_dtype is not None and objective == "saved":
            narrowed = self._narrowed_held(points[0])
            limits.append(limit * points[0].held_bytes // max(narrowed, 1))
        extra = []
        for measure_limit in limits:
            found = refined_within(
                self.choices.schedule, points, measure_limit, objective, compiled, built
            )
            if found is not None and found not in points + extra:
                extra.append(found)
        return points + extra

    def kept_bytes(self) -> int:
        """The bytes of one call's results a loop keeps bound through the next call: the same
        for every plan of the signature (recomputing changes no output)."""
        if self._kept is None:
            default = self.build()
            self._kept = _kept(default, default.peak_calls(), self.not_kept)
        return self._kept

    def _simulated_limits(self, limit: int) -> list[int]:
        """limit as the schedule's simulation of one call counts it (ir/step_schedule.py: the
        arrays passed in and a loop's kept results left out). A joint plan holds the kept
        results throughout; a forward and backward plan not while backward()'s runs, so the
        limit with them held and without are both targets there."""
        kept = self.kept_bytes()
        limits = [limit - self.input_bytes - kept]
        if kept and self.choices.schedule.two_plans:
            limits.append(limit - self.input_bytes)
        return limits

    def frontier(self, plans: bool = True) -> list[EvaluatedPoint]:
        """The plans worth choosing, in the order fit_peak tries them (fewest added FLOPs
        first; with allow_dtype the narrowed plans too, after the full-precision plan of equal
        FLOPs): each row lowers the peak of the row before it by at least `worth_lowering`
        bytes (1%), so peaks strictly fall as added FLOPs rise, and a row's peak as a budget picks
        that row or a cheaper plan (any plan tried before it peaks above it)."""
        kept: list[EvaluatedPoint] = []
        for e in self._evaluated(plans):
            if not kept or e.peak_bytes <= kept[-1].peak_bytes - worth_lowering(kept[-1]):
                kept.append(e)
        return kept or [self.evaluate_default(plans)]

    def smallest(self, plans: bool = True) -> EvaluatedPoint:
        """The plan of the lowest peak among all built (a row or not: a refusal's floor)."""
        return min(self._evaluated(plans), key=lambda e: e.peak_bytes, default=None) or (
            self.evaluate_default(plans)
        )

    def _evaluated(self, plans: bool = True) -> list[EvaluatedPoint]:
        with paused_gc():  # one pause over every row, not one per row
            evaluated = [
                self.evaluate(p, narrowed, plans) for p, narrowed in self.candidates(self.points())
            ]
        return sorted(
            evaluated, key=lambda e: (e.added_flops, e.saved_dtype is not None, e.peak_bytes)
        )

    def evaluate_default(self, plans: bool = True) -> EvaluatedPoint:
        return self.evaluate(PlanPoint(frozenset(), 0, 0, 0), plans=plans)

    def step_flops(self) -> int:
        plans = self.build()
        return sum(node_flops(n) for plan in plans.named.values() for n in plan.graph.nodes)

    def memory_frontier(self) -> MemoryFrontier:
        """The frontier's rows, and the smallest plan where it is no row (the floor a refusal
        names, under the last row by less than worth_lowering). The plans it builds only to
        read their peaks are let go (forget_plans); those built before it are kept. The
        collector stays paused until they are let go: resumed with every row's plans alive, its
        first young collection walked them all (~1.1 M objects, 0.19 s of a 10,086-node
        frontier) to free none of them (reference counting frees them, ir/lowering.py
        detached)."""
        with paused_gc():
            before = set(self._built)
            rows = self.frontier(plans=False)
            points = [_frontier_point(e) for e in rows]
            floor = self.smallest(plans=False)
            below = _frontier_point(floor) if floor.peak_bytes < rows[-1].peak_bytes else None
            del rows, floor  # they hold the plans too
            self.forget_plans(set(self._built) - before)
        return MemoryFrontier(self.name, points, self.step_flops(), self.input_bytes, below)

    # ---- budgets ------------------------------------------------------------------------------

    def fit_peak(self, limit: int):
        """The plans of the cheapest point whose step peak fits limit; MemoryBudgetError if none.
        The candidates built on the way that did not fit keep their peaks, not their plans."""
        self._check_inputs_fit(limit, "max_peak_bytes")
        self.fitted = ("max_peak_bytes", limit)
        before = set(self._built)
        for point, narrowed in self.candidates(self.points_for(limit)):
            evaluated = self.evaluate(point, narrowed, plans=False)
            if evaluated.peak_bytes <= limit:
                evaluated = self.with_plans(evaluated)
                self.forget_plans(set(self._built) - before - {(point.drop, narrowed)})
                self.narrowed_for = f"max_peak_bytes={limit:,}" if narrowed else None
                if point.drop:
                    self.recomputed_for = (f"max_peak_bytes={limit:,}", point, narrowed)
                return evaluated.plans
        default = self.evaluate_default()
        if default.peak_bytes <= limit:
            return default.plans
        raise MemoryBudgetError(self.refusal(limit, "max_peak_bytes"))

    def fit_saved(self, limit: int, default_plans):
        """saved_bytes_budget: the first plan of the saved chain (saved_chain) whose saved bytes
        (your own arrays excluded, the copies of NumPy arguments the backward reads counted, as
        explain's saved bytes count them) fit limit; MemoryBudgetError if none. In a step whose
        gradients come from an inlined value_and_grad, its saved bytes are the forward values
        those gradients read. A lower budget never gives a higher peak: along the chain saved
        bytes fall and peaks never rise, and a lower budget takes a later link (with allow_dtype,
        below the narrowed chain's end the full-precision chain's links follow, peaking above it:
        _full_precision_tail)."""
        chain = self.saved_chain(default_plans)
        chain = chain + self._full_precision_tail(default_plans, chain[-1].saved)
        self.fitted = ("saved_bytes_budget", limit)
        for link in chain:
            if link.saved <= limit:
                if link.narrowed:
                    self.narrowed_for = f"saved_bytes_budget={limit:,}"
                if link.point is not None and link.point.drop:
                    words = f"saved_bytes_budget={limit:,}"
                    self.recomputed_for = (words, link.point, link.narrowed)
                return link.plans
        raise MemoryBudgetError(self._saved_refusal(limit, chain))

    def _full_precision_tail(self, default_plans, fewest: int) -> list[SavedLink]:
        """With allow_dtype, what follows the narrowed chain's end (`fewest` saved bytes): a
        narrowed plan's low peak ends its chain early (every plan saving less peaks higher), and
        allowing a narrower dtype must not refuse a budget full precision meets. First the plans
        saving fewer than `fewest`, narrowed or not, as a chain of their own (fewest added FLOPs
        first, each saving less at a peak no higher); then the full-precision chain's links
        saving fewer than that tail's end. Below `fewest` the peak is above the narrowed chain's
        last."""
        if self.allow_dtype is None:
            return []
        if self._full_chain is None:
            self._full_chain = self._chain_of(default_plans, narrowing=False)
        tail: list[SavedLink] = []
        for point, narrowed in self._saved_candidates():
            evaluated = self.evaluate(point, narrowed)
            saved = self._saved_of(point, narrowed, evaluated.plans) - evaluated.fused
            if saved < (tail[-1].saved if tail else fewest) and (
                not tail or evaluated.peak_bytes <= tail[-1].peak
            ):
                tail.append(
                    SavedLink(saved, evaluated.peak_bytes, evaluated.plans, point, narrowed)
                )
        end = tail[-1].saved if tail else fewest
        return tail + [link for link in self._full_chain if link.saved < end]

    def saved_chain(self, default_plans) -> list[SavedLink]:
        """The plans saved_bytes_budget chooses from, fewest added FLOPs first: the default
        plan, then each candidate (the frontier's points for peak and for saved bytes, and with
        allow_dtype the same narrowed) that saves fewer bytes than the link before it at a
        peak no higher. Saved bytes are those explain prints: on numba the compiled plan's
        (values fused into the loop reading them are never stored: EvaluatedPoint.fused). A
        candidate saving less at a higher peak is left out: a budget that chose it would give
        a higher peak than a larger budget's plan."""
        if self._chain is None:
            self._chain = self._chain_of(default_plans, narrowing=True)
        return self._chain

    def _chain_of(self, default_plans, narrowing: bool) -> list[SavedLink]:
        default = self.evaluate_default()
        saved = self._default_saved(default_plans) - default.fused
        chain = [SavedLink(saved, default.peak_bytes, default_plans)]
        for point, narrowed in self._saved_candidates():
            if narrowed and not narrowing:
                continue
            evaluated = self.evaluate(point, narrowed)
            saved = self._saved_of(point, narrowed, evaluated.plans) - evaluated.fused
            last = chain[-1]
            if saved < last.saved and evaluated.peak_bytes <= last.peak:
                chain.append(
                    SavedLink(saved, evaluated.peak_bytes, evaluated.plans, point, narrowed)
                )
        return chain

    def _saved_candidates(self) -> list[tuple]:
        seen, points = set(), []
        for point in self.points("peak") + self.points("saved"):
            if point.drop not in seen:
                seen.add(point.drop)
                points.append(point)
        built = [(self.evaluate(p, n), p, n) for p, n in self.candidates(points)]
        built.sort(key=lambda b: (b[0].added_flops, b[2], -b[0].peak_bytes))
        return [(p, n) for _, p, n in built]

    def _saved_refusal(self, limit: int, chain: list[SavedLink]) -> str:
        """Why no plan of the saved chain fits: the fewest saved bytes it reaches, and (when
        plans outside it save fewer) why those are not used."""
        fewest = chain[-1]
        text = (
            f"{self.name}: saved_bytes_budget={limit:,} cannot be met: the fewest saved bytes a "
            f"plan keeps without a higher peak is {fewest.saved:,} (values the backward reads "
            "that nothing cheaper rebuilds"
        )
        if self.allow_dtype is not None:
            text += f", with the saved buffers in {np_dtype(self.allow_dtype).name}"
        text += ")"
        lower = [
            (self._saved_of(p, n, e.plans) - e.fused, e.peak_bytes)
            for p, n in self._saved_candidates()
            for e in (self.evaluate(p, n),)
        ]
        below = min((pair for pair in lower if pair[0] < fewest.saved), default=None)
        if below is not None:
            text += (
                f"; a plan keeping {below[0]:,} peaks at {format_bytes(below[1])}, above "
                f"the {format_bytes(fewest.peak)} of the plan keeping {fewest.saved:,}, and a "
                "lower saved budget never gives a higher peak"
            )
        text += self._saved_narrowing_text(limit)
        copies = self._numpy_copies_text(fewest.plans)
        text += f";{copies[:-1]}" if copies else ""
        return text + "; raise the budget or use max_peak_bytes (the whole step's peak)"

    def _saved_narrowing_text(self, limit: int) -> str:
        """With no narrower dtype allowed, whether allow_saved_dtype=bp.bfloat16 meets the
        refused saved_bytes_budget, and for what (as a refused max_peak_bytes says)."""
        if self.allow_dtype is not None or self.choices.options.saved_dtype is not None:
            return ""
        if _BRIEF[0]:
            return ""
        point = self._narrowed_fit("saved_bytes_budget", limit, "bf16")
        if point is None:
            return "; allow_saved_dtype=bp.bfloat16 (saved buffers in bfloat16) does not meet it"
        return f"; allow_saved_dtype=bp.bfloat16 meets it: {self._offer_words(point, 'bf16')}"

    def _default_saved(self, default_plans) -> int:
        """The bytes the default plan keeps for its gradients: a region's saved buffers, or,
        in a step whose gradients are an inlined value_and_grad's, the forward values its
        gradient part reads (ir/step_schedule.py held), your own arrays excluded."""
        if self.choices.inlined_gradients:
            return self.choices.schedule.held_bytes()
        return default_plans.saved_bytes + _copied_bytes(default_plans, self.numpy_inputs)

    def _saved_of(self, point, narrowed: bool, plans) -> int:
        """A built plan's saved bytes: a region's saved buffers, or what the inlined gradients
        of a training step read (as the schedule counts them, narrowed or not)."""
        if not self.choices.inlined_gradients:  # the copies of NumPy arguments it reads too
            return plans.saved_bytes + _copied_bytes(plans, self.numpy_inputs)
        return self._narrowed_held(point, plans) if narrowed else point.held_bytes

    def _check_inputs_fit(self, limit: int, option: str) -> None:
        if limit < self.input_bytes:
            raise MemoryBudgetError(
                f"{self.name}: {option}={limit:,} is smaller than the arrays passed in "
                f"({format_bytes(self.input_bytes)}); the step "
                "holds those at least"
            )

    def refusal(self, limit: int, option: str) -> str:
        """Why no plan fits: the smallest peak, its cost, what holds it there."""
        best = self.smallest(plans=False)
        default = self.evaluate_default(plans=False)
        step = max(self.step_flops(), 1)
        narrowed = (
            f"keeping its saved buffers in {np_dtype(best.saved_dtype).name} and "
            if best.saved_dtype
            else ""
        )
        cost = (
            f"{narrowed}recomputing {best.recomputed} more value(s) in "
            f"{self._backward_words()} for {best.added_flops:,} added FLOPs "
            f"(+{100 * best.added_flops / step:.1f}% of the step); the default plan peaks at "
            f"{format_bytes(default.peak_bytes)}"
            if best.peak_bytes < default.peak_bytes
            else f"the default plan's: recomputing in {self._backward_words()} lowers it no further"
        )
        last = self.frontier(plans=False)[-1]
        row = (
            f" (under memory_frontier's last row, {format_bytes(last.peak_bytes)}, by less than "
            "a row must lower it: listed below the rows)"
            if best.peak_bytes < last.peak_bytes
            else ""
        )
        text = (
            f"{self.name}: no plan fits {option}={limit:,} bytes. The smallest peak any plan "
            f"reaches is {format_bytes(best.peak_bytes)}{row}, {cost}. The arrays "
            f"passed in hold {format_bytes(self.input_bytes)} of those."
        )
        plans = self.with_plans(best).plans
        holders = holders_text(plans, self.not_kept, self.numpy_inputs)
        if holders:
            text += f" That peak is {holders}."
        copies = argument_copy_bytes(plans.peak_calls())
        if copies:
            text += (
                f" Up to {format_bytes(copies)} of it are copies each call makes of arguments "
                "in a layout it cannot read in place (explain names them): pass them "
                "np.ascontiguousarray(...) once, outside the loop."
            )
        text += self._numpy_copies_text(plans)
        return (
            text
            + self._narrowing_text(best, limit)
            + (
                " Ways out: a smaller batch (bp.max_batch(fn, args, max_peak_bytes=...) says the "
                "largest that fits), or a larger budget."
            )
        )

    def _numpy_copies_text(self, plans) -> str:
        """What of a refused budget the copies of NumPy arguments the backward reads take."""
        copied = _copied_bytes(plans, self.numpy_inputs)
        if not copied:
            return ""
        return (
            f" {format_bytes(copied)} of the saved bytes are copies of NumPy arguments the "
            "backward reads, taken at the call so that changing your arrays later cannot "
            "change the gradients: passing bp.tensor(...) of them (made once, outside the "
            "loop) saves those bytes."
        )

    def _backward_words(self) -> str:
        if self.choices.inlined_gradients and self.inlined:
            return f"the gradients of the value_and_grad called at {', '.join(self.inlined)}"
        return "the backward"

    def _narrowing_text(self, best: EvaluatedPoint, limit: int) -> str:
        """What 16-bit saved buffers would give (or gave) the refused budget: with no narrower
        dtype allowed, whether allow_saved_dtype=bp.bfloat16 fits it and for what (not while
        bp.max_batch probes sizes: brief_refusals)."""
        if self.choices.options.saved_dtype is not None or best.saved_dtype is not None:
            return ""
        if self.allow_dtype is None:
            point = None if _BRIEF[0] else self._narrowed_fit("max_peak_bytes", limit, "bf16")
            if point is not None:
                return (
                    f" allow_saved_dtype=bp.bfloat16 fits it: {self._offer_words(point, 'bf16')}."
                )
            return (
                " allow_saved_dtype=bp.bfloat16 would also let the planner keep the saved "
                "buffers in bfloat16 (no added FLOPs, a rounding)."
            )
        narrowed = self.evaluate(PlanPoint(best.drop, 0, 0, best.added_flops), True)
        return (
            f" With the saved buffers in {np_dtype(self.allow_dtype).name} "
            f"(allow_saved_dtype) the smallest peak is {format_bytes(narrowed.peak_bytes)}."
        )


_BRIEF = [0]  # > 0 while bp.max_batch probes sizes (brief_refusals)


@contextmanager
def brief_refusals():
    """Refusals that do not weigh bfloat16 saved buffers: bp.max_batch raises and catches one
    per size too large, and reads none of their words."""
    _BRIEF[0] += 1
    try:
        yield
    finally:
        _BRIEF[0] -= 1


def _narrowing(choices: PlanChoices, dtype: str) -> PlanChoices:
    """The same choices keeping saved values in dtype (the stage and schedule shared, no plan
    built yet)."""
    options = replace(choices.options, saved_dtype=dtype)
    return replace(choices, options=options, _default=None)


def _held_key(schedule, i: int) -> tuple:
    value = schedule.values[i]
    return value.op, value.shape, value.dtype, value.loc


def rebuilt_joint(choices: PlanChoices, drop: frozenset, dtype: str | None):
    """A value_and_grad's joint plan recomputing the held values drop names, its saved
    buffers kept in dtype (None: as computed)."""
    if dtype is not None and choices.options.saved_dtype != dtype:
        choices = _narrowing(choices, dtype)
    return choices.build(drop).plan


def _significant_bits(dtype: str) -> int:
    return {"bf16": 8, "f16": 11, "f32": 24, "f64": 53}[dtype]


def _rounding_words(dtype: str) -> str:
    """What reading a value stored in dtype costs in accuracy: rounded to nearest with p
    significant bits, each within 2**-p of the value computed (relative; float16 also
    overflows past its range)."""
    bits = _significant_bits(dtype)
    text = (
        f"rounded to {bits} significant bits (each within 2^-{bits}, "
        f"{100 * 2.0**-bits:.2g}%, of the value computed"
    )
    if dtype == "f16":
        text += "; beyond +-65,504 it is inf"
    return text + ")"


def _frontier_point(e: EvaluatedPoint) -> FrontierPoint:
    dtype = np_dtype(e.saved_dtype).name if e.saved_dtype else None
    saved = e.saved_bytes - e.fused + e.more_saved
    return FrontierPoint(e.peak_bytes, e.added_flops, e.recomputed, saved, dtype)


def worth_lowering(row: EvaluatedPoint) -> int:
    """The least a frontier row must lower the peak of the row before it by: 1% of that peak.
    A smaller gain is below what a process's memory shows (pages, allocator rounding; the
    fresh-process check of the prediction allows 5% + 8 MiB) while the plan adds FLOPs or
    rounds the saved buffers; real steps are far larger (the planner frees values in batches
    of about 1/24 of the peak on the bench models, one tanh layer is 6-10% in the docs). Such a
    plan stays a candidate: a budget between rows may still run it (fit_peak tries each)."""
    return max(1, row.peak_bytes // 100)


def inlined_budget_refusal(fn, limit: int) -> str:
    """Why a value_and_grad with max_peak_bytes is refused inside a traced function (a
    compiled training step): its joint plan is inlined and the step's plan, made as a whole,
    does not keep the recomputation the budget chose."""
    name = getattr(fn, "__name__", type(fn).__name__)
    return (
        f"value_and_grad({name}, max_peak_bytes={limit:,}) at {loc_text(user_frame_loc())} is "
        "called inside a traced function (a bp.compile step): its joint plan is inlined into "
        "the step's, whose peak (the optimizer update and the step's other buffers included) "
        "is what a budget must bound. Give the budget to the step instead: "
        f"bp.compile(step, max_peak_bytes={limit:,}) recomputes in the inlined gradients"
    )


def nested_budget_refusal(fn, budget: str) -> str:
    """Why a compiled function with a budget is refused when called inside another traced
    function: its plan is inlined into the enclosing one, made as a whole."""
    name = getattr(fn, "__name__", type(fn).__name__)
    return (
        f"bp.compile({name}, {budget}) at {loc_text(user_frame_loc())} is called inside a "
        "traced function: its plan is inlined into the enclosing one, whose peak is what a "
        "budget must bound, so this budget would not hold. Give it to the outermost "
        f"function instead (bp.compile(step, {budget.split('=')[0]}=N), or "
        "bp.value_and_grad(fn, max_peak_bytes=N))"
    )


def _with_saved_chain(points: list, saved_chain: list) -> list:
    """A compiled forward plan and backward plan (a loss backward() follows): the schedule's
    simulation of their peak leaves out what fused loops hold, so the peak chain can stop at
    the default plan while plans of the saved chain (each value dropped lowers the held bytes)
    peak lower once built. Their drop sets join the candidates; frontier() and fit_peak judge
    every candidate by its built plan's peak (ir/peak.py)."""
    seen = {p.drop for p in points}
    return points + [p for p in saved_chain if p.drop not in seen]
