"""The predicted peak of a step: the most bytes it holds at any point, per category, step by
step, for the executor that runs it, before anything runs.

A step is a sequence of plan calls (a forward, then a backward; or one joint plan). Categories:
inputs (the caller's arrays), donated (inputs whose buffers outputs are written into),
constants, scratch (compiled arenas, kept across calls: a library kernel's workspace, conv2d's
im2col columns, is a buffer of its plan's arena, ir/kernel_workspace.py), packing (the pages
of backplan's GEMM packing buffers the step's products write, kept by the process:
ir/gemm_packing.py), copies (a compiled
call's C-order copy of each argument passed in another layout,
ir/argument_layout.py, and a NumPy argument the call copies for itself alone: held while that
call runs), temporaries (reference interpreter only),
outputs, saved (forward values the backward reads), gradients.

- Compiled (numba): every plan of the step keeps its scratch arena and constants for its whole
  life (a forward and the backward() consuming it share one arena, the larger's size), and a
  call allocates all its output buffers before its first kernel, holding them until the step
  ends (outputs and gradients go to the caller, saved buffers until the backward returns).
  The buffers therefore peak at the first kernel of the last call.
- Reference: every buffer NumPy allocates (a view lives in its input's buffer:
  ir/reference_storage.py), from the step that writes it to the free of the last value living
  in it; saved values until the backward frees them.

>>> from backplan.ir.peak import PeakReport, PeakStep
>>> step = PeakStep(0, "joint", "matmul", "m.py:3", {"inputs": 8, "outputs": 4})
>>> r = PeakReport("numba", (step,))
>>> r.peak_bytes, r.fits(11), r.fits(12), r.allocated_peak_bytes
(12, False, True, 4)
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field, replace

from .argument_layout import stored_bytes
from .gemm_packing import packing_bytes
from .liveness import INPUT_STEP, Plan
from .lowering import lower, runs_code
from .plan_buffers import compiled_buffers
from .printer import format_loc
from .reference_storage import storage_roots
from .types import DTYPES
from .widen import has_half

CATEGORIES = (
    "inputs",
    "donated",
    "constants",
    "scratch",
    "packing",
    "copies",
    "temporaries",
    "outputs",
    "saved",
    "gradients",
)
CALLER_OWNED = ("inputs", "donated")  # passed in: not allocated by the step


@dataclass(frozen=True)
class PeakStep:
    """Bytes held while one kernel (compiled) or one IR step (reference) runs."""

    index: int
    plan: str  # "forward", "backward", "joint"
    what: str  # the kernel's ops, "matmul" or "loop: mul, exp, sum"
    line: str  # the user's file:line of the step ("" when unknown)
    held: dict  # category -> bytes

    @property
    def nbytes(self) -> int:
        return sum(self.held.values())


@dataclass(frozen=True)
class PeakReport:
    """See the module docstring. `peak_bytes` counts the caller's arrays (inputs, donated);
    `allocated_peak_bytes` is what the step itself allocates or keeps at its peak."""

    backend: str
    steps: tuple[PeakStep, ...]
    buffers: tuple = ()  # (call label, PlannedBuffer) of a compiled step, for the checked mode

    @property
    def peak_step(self) -> PeakStep | None:
        if not self.steps:
            return None
        return max(self.steps, key=lambda s: (s.nbytes, -s.index))

    @property
    def peak_bytes(self) -> int:
        step = self.peak_step
        return step.nbytes if step is not None else 0

    @property
    def input_bytes(self) -> int:
        """The caller's own arrays (donated ones included): held by the caller, not allocated."""
        step = self.peak_step
        return sum(step.held.get(c, 0) for c in CALLER_OWNED) if step is not None else 0

    @property
    def allocated_peak_bytes(self) -> int:
        """The most bytes of the step's own buffers held at once (what the checked mode's
        counting allocator sees): the peak less the caller's arrays."""
        own = [s.nbytes - sum(s.held.get(c, 0) for c in CALLER_OWNED) for s in self.steps]
        return max(own, default=0)

    def at_peak(self) -> dict:
        """category -> bytes at the peak, categories that hold nothing left out."""
        step = self.peak_step
        return {c: n for c, n in step.held.items() if n} if step is not None else {}

    def fits(self, nbytes: int) -> bool:
        """Whether the step's peak, the caller's arrays included, is at most nbytes."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Integral) or nbytes < 0:
            raise ValueError(f"fits() needs a byte count (an int >= 0), got {nbytes!r}")
        return self.peak_bytes <= int(nbytes)  # NumPy's integers count: a.nbytes * 4 is one


@dataclass(frozen=True)
class PlanCall:
    """One plan run as part of a step. output_kinds: the category of each graph output.
    input_kinds: per graph input, "inputs", "donated", "copied" (a NumPy array the caller
    passed, which the step copies at the call and holds for its backward: the caller's array
    and the copy, counted as saved until the step ends), "copied out" (a NumPy array an output
    reads, copied at the call: the copy is that output, held to the step's end), "copied in"
    (a NumPy array copied for the call alone, held while it runs: another byte order, or on
    the reference interpreter an array not in C order that a reshape reads), "held" (a buffer
    an earlier call of the step produced, already counted: a backward's saved inputs) or
    "cotangent" (backward()'s seed, or the zeros of an output it did not start from: arrays
    backward() allocates, not the caller's, counted as gradients while that call runs).
    held_from: for the reference interpreter, input index -> (call, output index) of that
    earlier buffer."""

    label: str
    plan: Plan
    output_kinds: tuple[str, ...]
    input_kinds: tuple[str, ...]
    private_saved: tuple[int, ...] = ()
    held_from: dict = field(default_factory=dict)
    # for the reference interpreter, input index -> (call, input index) of an earlier call's
    # input this call reads as a saved buffer (a backward's saved forward inputs): a COPIED one
    # is the step's own buffer, freed after this call's last read of it
    held_inputs: dict = field(default_factory=dict)
    # a plan the step keeps compiled but does not run (a joint step's forward and backward,
    # which ran its first calls): its scratch arena and constants are held, nothing else
    idle: bool = False
    # False: an idle plan that freed its arena (runtime/joint_step.py), its constants held
    keeps_arena: bool = True
    # Plan.copied: the inputs passed in another layout than C order, which the compiled call
    # copies whole on entry (held until it returns) unless its lowering reads them in place
    copied: tuple = ()
    # compiled: the plan draws its scratch arena from the one the step's other such calls
    # share (a forward and the backward() consuming it: runtime/program.py), so the step
    # holds one arena of the largest's size, not one each
    shares_arena: bool = False


def predicted_peak(calls: list[PlanCall], backend: str = "numba") -> PeakReport:
    """The step's predicted peak on `backend` ("numba": the compiled plans; "reference")."""
    if backend == "reference":  # the interpreter keeps nothing for a plan between its calls
        return PeakReport("reference", tuple(_reference_steps([c for c in calls if not c.idle])))
    if backend != "numba":
        raise ValueError(f"unknown backend {backend!r}; use 'numba' or 'reference'")
    return _compiled_report(calls)


def _input_bytes(calls: list[PlanCall]) -> dict:
    """The caller's arrays, each at the bytes it occupies (a broadcast view its compact array,
    a sliced one its span: ir/argument_layout.py stored_bytes), and the copies of those saved
    for a backward, each as big."""
    held = dict.fromkeys(CATEGORIES, 0)
    for call in calls:
        if call.idle:
            continue
        for i, kind, nbytes in _input_sizes(call):
            if kind in CALLER_OWNED:
                held[kind] += nbytes
            elif kind == COPIED:  # the caller's array, and backplan's copy of it
                held["inputs"] += nbytes
                held["saved"] += nbytes
            elif kind == COPIED_OUT:  # the copy is an output: held from the call on
                held["inputs"] += nbytes
                held["outputs"] += call.plan.graph.inputs[i].type.nbytes
            elif kind == COPIED_IN:  # the copy is counted while its call runs (_copied_in)
                held["inputs"] += nbytes
    return held


def _input_sizes(call: PlanCall):
    """(index, kind, bytes it occupies) of each input of the call."""
    layouts = dict(call.copied)
    for i, (value, kind) in enumerate(zip(call.plan.graph.inputs, call.input_kinds, strict=True)):
        nbytes = value.type.nbytes
        if i in layouts and value.shape and nbytes:
            nbytes = stored_bytes(value.shape, DTYPES[value.dtype].itemsize, layouts[i])
        yield i, kind, nbytes


COPIED = "copied"
COPIED_OUT = "copied out"
COPIED_IN = "copied in"


def with_argument_copies(
    calls: list[PlanCall] | None, inputs, copy: str = COPIED
) -> list[PlanCall] | None:
    """The step's calls where the forward inputs `inputs` are NumPy arrays the step copies at
    the call (tracer/numpy_args.py): the call taking the forward's inputs (the forward, or a
    joint step's joint plan) marks them `copy`: COPIED (held for the backward), COPIED_OUT
    (an output reads it, or is written into it: a donated one) or COPIED_IN (held while the
    call runs); an input marked already keeps its mark."""
    if not calls or not inputs:
        return calls
    return [
        replace(
            c,
            input_kinds=tuple(
                copy if i in inputs and kind in CALLER_OWNED else kind
                for i, kind in enumerate(c.input_kinds)
            ),
        )
        if c.label in ("forward", "joint") and not c.idle
        else c
        for c in calls
    ]


def _cotangent_bytes(call: PlanCall) -> int:
    """What backward() allocates for a backward plan's cotangent inputs (its seed): held while
    that call runs, as a gradient (the loss's own), never the caller's array."""
    return sum(
        v.type.nbytes
        for v, kind in zip(call.plan.graph.inputs, call.input_kinds, strict=True)
        if kind == "cotangent"
    )


def _copied_in(call: PlanCall) -> int:
    """Bytes of the NumPy arguments copied for this call alone (COPIED_IN), held while it runs."""
    if COPIED_IN not in call.input_kinds:
        return 0
    inputs = call.plan.graph.inputs
    return sum(
        inputs[i].type.nbytes for i, kind in enumerate(call.input_kinds) if kind == COPIED_IN
    )


def copy_bytes(lowered) -> int:
    """Bytes of the C-order copies a compiled call makes of the inputs passed in another layout
    (the lowered plan's `copied`: those it does not read in place, ir/in_place_inputs.py): the
    whole of each, whatever the view it copies holds."""
    plan = lowered.plan
    return sum(plan.graph.inputs[i].type.nbytes for i, _ in plan.copied)


def argument_copy_bytes(calls: list[PlanCall]) -> int:
    """The most bytes of argument copies one compiled call of the step makes (copy_bytes),
    0 where every argument is in C order or read in place."""
    return max(
        (copy_bytes(lower(c.plan, c.private_saved)) for c in calls if c.copied and not c.idle),
        default=0,
    )


def building_peak(calls: list[PlanCall]) -> PeakReport:
    """A step compiled with background=True while its kernels build: each call runs on the
    reference interpreter (its accounting, step by step) and each compiled plan keeps the
    scratch arena it allocated when it was made, for its first call (codegen/run/workspace.py),
    from that call on; an idle plan (made by earlier calls) its arena and constants."""
    running = [c for c in calls if not c.idle]
    seen = {id(a) for c in running for a in c.plan.graph.constants.values()}
    kept, constants = 0, 0
    for call in calls:
        if call.idle:
            kept += _arena_bytes(call) if call.keeps_arena else 0
            for array in call.plan.graph.constants.values():
                constants += 0 if id(array) in seen else array.nbytes
                seen.add(id(array))
    arenas, shared = {}, 0
    for call in running:  # a shared arena grows to the largest plan made so far
        if call.shares_arena:
            grown = max(shared, _arena_bytes(call))
            kept, shared = kept + grown - shared, grown
        else:
            kept += _arena_bytes(call)
        arenas[call.label] = kept
    steps = tuple(
        replace(s, held=_plus(s.held, scratch=arenas[s.plan], constants=constants))
        for s in predicted_peak(running, "reference").steps
    )
    return PeakReport("reference", steps)


def _arena_bytes(call: PlanCall) -> int:
    buffers = compiled_buffers(lower(call.plan, call.private_saved), list(call.output_kinds))
    return sum(b.nbytes for b in buffers if b.category == "scratch")


def _plus(held: dict, **more: int) -> dict:
    return {**held, **{k: held.get(k, 0) + n for k, n in more.items()}}


def predicted_peak_bytes(calls: list[PlanCall], backend: str = "numba", kept: int = 0) -> int:
    """predicted_peak(calls, backend).peak_bytes, the same accounting without describing every
    kernel's step (its ops and line): the memory planner asks it of every plan it weighs, and
    a 10,000-node plan has 10,000 steps to word. kept: bytes of the previous call's results a
    loop holds while every plan but backward()'s runs (report/loop_peak.py holding)."""
    if backend != "numba":
        steps = predicted_peak(calls, backend).steps
        return max((s.nbytes + _kept_during(s.plan, kept) for s in steps), default=0)
    lowered, per_call, held = _compiled_held(calls, named=False)  # bytes only: no names
    peak = 0
    for call, low, buffers in zip(calls, lowered, per_call, strict=True):
        if call.idle:
            continue
        for b in buffers:
            if b.category not in ("constants", "scratch"):
                held[b.category] += b.nbytes
        held["packing"] = max(held["packing"], packing_bytes(low))
        seed = _cotangent_bytes(call) + copy_bytes(low) + _copied_in(call)
        during = sum(held.values()) + seed + _kept_during(call.label, kept)
        peak = max(peak, during)
    return peak


def _kept_during(plan: str, kept: int) -> int:
    """A loop's kept results are bound while a call's plans run, not while backward()'s
    runs: `loss = f(params, x)` has let the old loss go by then."""
    return 0 if plan == "backward" else kept


def _compiled_held(calls: list[PlanCall], named: bool = True) -> tuple[list, list, dict]:
    """(each call's lowered plan, its buffers, the bytes held before its first kernel: the
    caller's arrays, every plan's constants (each array once) and scratch arena). named:
    the buffers named (compiled_buffers)."""
    lowered = [lower(c.plan, c.private_saved) for c in calls]
    per_call = [
        compiled_buffers(low, list(c.output_kinds), named)
        for c, low in zip(calls, lowered, strict=True)
    ]
    held = _input_bytes(calls)
    constants_seen: set[int] = set()
    shared = 0  # the one arena the sharing calls draw from: the largest of theirs
    for call, buffers in zip(calls, per_call, strict=True):
        for b in buffers:
            if b.category == "constants":
                array = call.plan.graph.constants[b.key.removeprefix("const ")]
                if id(array) not in constants_seen:
                    constants_seen.add(id(array))
                    held["constants"] += b.nbytes
            elif b.category == "scratch" and call.keeps_arena:
                if call.shares_arena:
                    shared = max(shared, b.nbytes)
                else:
                    held["scratch"] += b.nbytes  # every other plan of the step keeps its own
    held["scratch"] += shared
    return lowered, per_call, held


def _compiled_report(calls: list[PlanCall]) -> PeakReport:
    lowered, per_call, held = _compiled_held(calls)
    steps, index = [], 0
    for call, low, buffers in zip(calls, lowered, per_call, strict=True):
        if call.idle:
            continue
        for b in buffers:
            if b.category not in ("constants", "scratch"):
                held[b.category] += b.nbytes  # allocated on entry, held to the step's end
        # the GEMM's kept packing buffers: written by the call's products, kept (a step's
        # plans share them: the most any call so far writes)
        held["packing"] = max(held["packing"], packing_bytes(low))
        seed = _cotangent_bytes(call)  # backward()'s seed: made before it, freed after it
        held["gradients"] += seed
        copies = copy_bytes(low) + _copied_in(call)  # made on entry, freed when it returns
        for group in _driver_calls(low):
            running = dict(held, copies=copies)
            steps.append(PeakStep(index, call.label, *_kernel_words(group), running))
            index += 1
        held["gradients"] -= seed
    buffers = tuple(
        (c.label, b) for c, bs in zip(calls, per_call, strict=True) if not c.idle for b in bs
    )
    return PeakReport("numba", tuple(steps), buffers)


def _driver_calls(lowered) -> list[list]:
    """The kernels of each call the driver makes (a row kernel's stages together: one loop
    over the rows runs them; a matmul + epilogue the rendering runs as a BLAS call and then
    the loop as those two, and a kernel run as several calls as those, where the plan was
    rendered already), in run order; [[]] for a plan of views and literals only."""
    kernels = lowered.kernels
    apart = getattr(lowered.rendered, "epilogues_apart", ())
    calls_of = getattr(lowered.rendered, "calls_of", {})

    def loop(kernel) -> list[list]:  # one step per call it runs as (a long sum's shared adds)
        return [[kernel]] * (calls_of.get(kernel.nodes[-1], 1) if kernel.nodes else 1)

    calls: list[list] = []
    for a, b in lowered.calls():
        group = [k for k in kernels[a:b] if runs_code(k)]
        if len(group) == 1 and group[0].epilogue is not None and group[0].nodes[0] in apart:
            calls += [[replace(group[0], epilogue=None)], *loop(group[0].epilogue)]
        elif len(group) == 1:
            calls += loop(group[0])
        else:
            calls.append(group)
    return calls or [[]]


def _kernel_words(group: list) -> tuple[str, str]:
    if not group:
        return "no kernels (views and literals only)", ""
    nodes = [n for k in group for n in k.all_nodes]
    ops = ", ".join(dict.fromkeys(n.op for n in nodes))
    rows = f"row loop of {len(group)} stages" if len(group) > 1 else "loop"
    what = f"{rows}: {ops}" if group[0].kind == "loop" else ops
    lines = [format_loc(n.loc) for n in nodes if n.loc]
    return what, lines[-1] if lines else ""


def _reference_steps(calls: list[PlanCall]):
    """Every buffer the interpreter allocates (a view shares its input's: ir/reference_storage),
    held from its step until the free of the last value that lives in it (run_plan's
    accounting); the caller's arrays, constants and views of them allocate nothing."""
    calls = [_as_interpreted(c) for c in calls]
    total = sum(len(c.plan.graph.nodes) for c in calls)
    inputs = _input_bytes(calls)
    constants = sum(
        a.nbytes
        for a in {id(a): a for c in calls for a in c.plan.graph.constants.values()}.values()
    )
    deltas = [dict.fromkeys(CATEGORIES, 0) for _ in range(total + 1)]
    offsets, offset = [], 0
    for call in calls:
        offsets.append(offset)
        offset += len(call.plan.graph.nodes)
    frees = [_free_steps(c.plan) for c in calls]
    roots = [storage_roots(c.plan.graph) for c in calls]
    for c, call in enumerate(calls):
        graph, start = call.plan.graph, offsets[c]
        seed = _cotangent_bytes(call)  # made before the call, freed after it
        deltas[start]["gradients"] += seed
        deltas[start + len(graph.nodes)]["gradients"] -= seed
        for i, kind, nbytes in _input_sizes(call):
            if kind == COPIED:  # made before the call, freed after the backward's last read
                end = _copy_end(c, i, calls, offsets, frees, roots, total)
                deltas[start]["saved"] += nbytes
                deltas[min(end, total - 1) + 1]["saved"] -= nbytes
            elif kind == COPIED_OUT:  # an output: held to the step's end
                deltas[start]["outputs"] += graph.inputs[i].type.nbytes
            elif kind == COPIED_IN:  # made before the call, freed when it returns
                deltas[start]["copies"] += graph.inputs[i].type.nbytes
                deltas[start + len(graph.nodes)]["copies"] -= graph.inputs[i].type.nbytes
        step_of = {node: step for step, node in enumerate(graph.nodes)}
        kinds: dict = {}
        for o, kind in zip(graph.outputs, call.output_kinds, strict=True):
            kinds.setdefault(o, kind)
        for root, members in _alias_groups(graph, roots[c]).items():
            if root.op == "const" or root not in step_of:
                continue  # the caller's array, a constant, or an earlier call's buffer
            member_kinds = {kinds[m] for m in members if m in kinds}
            kind = next((k for k in _HELD_KINDS if k in member_kinds), "temporaries")
            context = (c, calls, offsets, frees, roots, start, total)
            end = max(_reference_end(m, kinds.get(m, "temporaries"), *context) for m in members)
            deltas[start + step_of[root]][kind] += root.type.nbytes
            deltas[min(end, total - 1) + 1][kind] -= root.type.nbytes
    held = dict.fromkeys(CATEGORIES, 0)
    for key in CALLER_OWNED:
        held[key] = inputs[key]
    held["constants"] = constants
    index = 0
    for c, call in enumerate(calls):
        for step, node in enumerate(call.plan.graph.nodes):
            for kind, change in deltas[offsets[c] + step].items():
                held[kind] += change
            line = format_loc(node.loc)
            yield PeakStep(index, call.label, node.op, line, dict(held))
            index += 1


_HELD_KINDS = ("outputs", "gradients", "saved")  # a buffer any output lives in is that output


def _alias_groups(graph, roots: dict) -> dict:
    """storage root -> the values living in it (the root first)."""
    groups: dict = {}
    for node in graph.nodes:
        groups.setdefault(roots[node], []).append(node)
    return groups


def _as_interpreted(call: PlanCall) -> PlanCall:
    """The call as the reference interpreter runs it: a plan with 16-bit values widened, its
    float32 values between roundings held where the compiled loops hold them
    (`lower(plan).interpreted`: ir/widen.py, ir/rounding_points.py)."""
    if not has_half(call.plan.graph):
        return call
    return replace(call, plan=lower(call.plan).interpreted or call.plan)


def _reference_end(node, kind, c, calls, offsets, frees, roots, start, total) -> int:
    """The last global step a value of call c keeps its buffer over."""
    if kind != "saved":
        if kind in ("outputs", "gradients"):
            return total - 1
        return start + min(frees[c].get(node, len(calls[c].plan.graph.nodes)), _last(calls[c]))
    for later in range(c + 1, len(calls)):
        call = calls[later]
        for i, (src_call, out) in call.held_from.items():
            if src_call == c and calls[c].plan.graph.outputs[out] is node:
                inp = call.plan.graph.inputs[i]
                views = [v for v, r in roots[later].items() if r is inp]
                free = max(frees[later].get(v, len(call.plan.graph.nodes)) for v in views)
                return offsets[later] + max(min(free, _last(call)), 0)
    return total - 1


def _copy_end(c, index, calls, offsets, frees, roots, total) -> int:
    """The last global step the copy of call c's input `index` (COPIED) is held over: to the
    free of the last value of the later call reading it as a saved buffer, else the end."""
    for later in range(c + 1, len(calls)):
        call = calls[later]
        for i, source in call.held_inputs.items():
            if source == (c, index):
                inp = call.plan.graph.inputs[i]
                views = [v for v, r in roots[later].items() if r is inp] or [inp]
                free = max(frees[later].get(v, len(call.plan.graph.nodes)) for v in views)
                return offsets[later] + max(min(free, _last(call)), 0)
    return total - 1


def _last(call: PlanCall) -> int:
    return len(call.plan.graph.nodes) - 1


def _free_steps(plan: Plan) -> dict:
    """The step after which each value is freed (inputs freed on entry: step 0)."""
    return {
        v: max(step, 0) if step != INPUT_STEP else 0
        for step, values in plan.frees_after.items()
        for v in values
    }


def region_calls(plans, consume: bool = True) -> list[PlanCall]:
    """A compiled function's step: its forward (outputs, then saved values), then, when
    something needs a gradient, its backward (cotangents and saved buffers in, gradients out;
    consume: backward() without retain_graph, which may reuse private saved buffers).
    plans: an ir.pipeline.RegionPlans."""
    forward = plans.forward
    n, donated = plans.n_outputs, forward.donated
    calls = [
        PlanCall(
            "forward",
            forward,
            tuple("outputs" if i < n else "saved" for i in range(len(forward.graph.outputs))),
            tuple(
                "donated" if i in donated else "inputs" for i in range(len(forward.graph.inputs))
            ),
            copied=forward.copied,
            shares_arena=True,
        )
    ]
    if plans.backward is None:
        return calls
    backward, n_cot = plans.backward, plans.n_cotangents
    held_from = {
        n_cot + slot: (0, s.source[1])
        for slot, s in enumerate(plans.saved)
        if s.source[0] == "output"
    }
    calls.append(
        PlanCall(
            "backward",
            backward,
            ("gradients",) * len(backward.graph.outputs),
            ("cotangent",) * n_cot + ("held",) * len(plans.saved),
            plans.private_saved_inputs() if consume else (),
            held_from=held_from,
            shares_arena=consume,
            held_inputs={
                n_cot + slot: (0, s.source[1])
                for slot, s in enumerate(plans.saved)
                if s.source[0] == "input"
            },
            copied=backward.copied,
        )
    )
    return calls


def joint_calls(plan: Plan, n_outputs: int) -> list[PlanCall]:
    """value_and_grad's one joint plan: outputs (the loss and aux), then gradients."""
    graph = plan.graph
    return [
        PlanCall(
            "joint",
            plan,
            tuple("outputs" if i < n_outputs else "gradients" for i in range(len(graph.outputs))),
            tuple("donated" if i in plan.donated else "inputs" for i in range(len(graph.inputs))),
            copied=plan.copied,
        )
    ]
