"""The peak one rank holds in a data-parallel step, in the loop users write (`loss, grads =
step(params, *batch)`, or `params, state, loss = step(params, state, *batch)` with an
optimizer): the joint plan's own peak (ir/peak.py) plus what the exchange and the update add.

The step runs in phases, each holding what the one before left alive:
- the plan: the joint plan's kernels, with its scratch arena and outputs (the gradients are
  the bucket buffers themselves where the compiled driver starts the buckets, in_plan.py);
- packing (buckets started after the call): each bucket a new buffer beside the gradients;
- the update (optimizer=): the summed gradients (views of the buckets, or ZeRO-1's pooled
  receive buffers) read by the compiled update, which allocates the new parameters and state;
- held between calls: what stays allocated when the call has returned (arenas, pooled buffers,
  the caller's arrays and the results the loop keeps), the floor the next call starts from.

Every phase counts the caller's arrays (parameters, batch, optimizer state), every plan's
scratch arena and constants (kept for the plan's life), the buffers the exchange keeps between
calls (in-plan bucket buffers, ZeRO-1's send, receive and all-gather buffers) and the previous
call's results the loop still binds, and the big outputs a plan's workspace keeps for its next
call (codegen/run/workspace.py) once the step is done with them; on 2 ranks of MPICH, MPI's
receive buffer for each bucket in flight (recursive doubling, world.py). The checked mode
(BACKPLAN_CHECK_MEMORY=1) counts the exchange's buffers too (`counted`), so a test compares its
measured peak with `counted_bytes` (which leaves out the batch, the kernels' workspace and the
MPI library's buffers, none of which pass through its allocator)."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

import numpy as np

from backplan.codegen.run.memory_check import ALLOCATOR, checking
from backplan.codegen.run.workspace import REUSE_BYTES
from backplan.ir.types import np_dtype

from .half_sum import sent_in_16_bits
from .half_wire import summed_dtype
from .window_views import summed_in_place

# what the checked mode's counting allocator never sees
NOT_COUNTED = ("batch", "workspace", "MPI buffers", "node window")


def counted(array: np.ndarray, name: str) -> np.ndarray:
    """`array` (a buffer the exchange allocated or keeps) counted by the checked mode."""
    if checking():
        ALLOCATOR.use(array, name)
    return array


@dataclass(frozen=True)
class RankPhase:
    name: str
    held: dict  # category -> bytes

    @property
    def nbytes(self) -> int:
        return sum(self.held.values())


@dataclass(frozen=True)
class RankPeak:
    """Bytes one rank holds in each phase of a step (steady loop calls); `peak_bytes` the most."""

    phases: tuple[RankPhase, ...]
    between: RankPhase  # what stays allocated between two calls
    not_counted: tuple[str, ...] = NOT_COUNTED  # categories the checked mode never sees
    first_call: RankPeak | None = None  # the loop's first call, where it differs
    # the loop's second call, where it differs: the plan's workspace still keeps the big
    # output buffers the first call's gradients were written into (from the second call on
    # they are written into the node's window) while the plan runs
    second_call: RankPeak | None = None

    @property
    def most_bytes(self) -> int:
        """The most bytes one rank holds in any call of the loop (its first included)."""
        calls = (self.first_call, self.second_call)
        return max(self.peak_bytes, *(c.peak_bytes for c in calls if c is not None))

    @property
    def peak_phase(self) -> RankPhase:
        return max(self.phases, key=lambda p: p.nbytes)

    @property
    def peak_bytes(self) -> int:
        return self.peak_phase.nbytes

    @property
    def counted_bytes(self) -> int:
        """The peak as the checked mode counts it: everything but the caller's own arrays
        (the batch; the parameters too where no update allocated them) and the kernels'
        workspace (allocated inside them), at the phase holding the most of it. That need not
        be the peak's phase: a first call's plan runs before the node window exists (not
        counted either), and with every bucket summed in place no later phase holds its
        outputs."""
        return max(
            phase.nbytes - sum(phase.held.get(c, 0) for c in self.not_counted)
            for phase in self.phases
        )

    @property
    def growth_bytes(self) -> int:
        """What a call newly allocates at its peak over what is held between calls: the growth
        of peak resident memory over one call (VmHWM after it less VmRSS before it)."""
        return self.peak_bytes - self.between.nbytes

    def lines(self) -> list[str]:
        phase = self.peak_phase
        parts = ", ".join(f"{c} {n:,}" for c, n in phase.held.items() if n)
        others = "; ".join(f"{p.name} {p.nbytes:,}" for p in self.phases if p is not phase)
        head = f"Per-rank peak: {self.most_bytes:,} B"
        if self.most_bytes != self.peak_bytes:  # the first call holds the most
            later = "third" if self.second_call is not None else "second"
            head += f" in the first call (below); from the {later} call on {self.peak_bytes:,} B"
        text = (
            f"{head}, while {phase.name} ({parts}). Other phases: "
            f"{others}; held between calls {self.between.nbytes:,} B. Counted as the loop "
            f"holds it from its {'third' if self.second_call else 'second'} call on: the "
            "caller's arrays, every compiled plan's "
            "arena, the exchange's buffers and the results the loop still binds"
        )
        if any(p.held.get("node window") for p in self.phases):
            text += (
                ", and this rank's segment of the node's shared window the gradients are "
                "summed in (each buffer three times, used in turn by successive calls; float32 "
                "for the sums of 16-bit buckets summed whole; the buckets summed in place there "
                "hold the results the loop "
                "binds), "
                "made in the step's first call that exchanges and freed when the step is "
                "collected."
            )
        else:
            text += (
                ", and MPI's buffer for each bucket in flight (MPICH's recursive doubling)."
                if any("MPI buffers" in p.held for p in self.phases)
                else ". Not counted: what the MPI library allocates for a collective in flight "
                "(its algorithm's; MPICH's default on 2 ranks: about half of each bucket)."
            )
        if self.second_call is not None:
            second = self.second_call.peak_phase
            text += (
                f" The second call holds {second.nbytes:,} B at most, while {second.name}: the "
                f"plan's workspace still keeps the output buffers of {REUSE_BYTES:,} B or more "
                "the first call's gradients were written into."
            )
        if self.first_call is not None:
            first = self.first_call.peak_phase
            made = " (the window is made after the plan)" if first.held.get("node window") else ""
            parts = ", ".join(f"{c} {n:,}" for c, n in first.held.items() if n)
            text += (
                f" The first call holds {first.nbytes:,} B at most, while {first.name} ({parts}): "
                "nothing "
                "bound from a previous call, the plan's gradients in output buffers of its "
                f"own{made}."
            )
        return textwrap.wrap(text, 98, initial_indent="  ", subsequent_indent="  ")


@dataclass(frozen=True)
class PlanFacts:
    """Bytes of one compiled plan's call at its peak kernel (ir.peak.PeakReport)."""

    inputs: int  # the caller's arrays it reads
    kept: int  # scratch arena, constants and GEMM packing pages, held for the plan's life
    outputs: int  # output buffers (outputs, gradients, saved) it allocates per call
    workspace: int  # the most a kernel allocates inside itself
    # outputs of at least REUSE_BYTES: the plan's workspace keeps them after the call, to reuse
    # in the next one when nobody holds them (codegen/run/workspace.py), so they stay
    # allocated once the step is done with them
    reused: tuple[int, ...] = ()

    @classmethod
    def of(cls, peak) -> PlanFacts:
        if not peak.steps:
            return cls(0, 0, 0, 0)
        held = peak.steps[-1].held
        kinds = ("outputs", "gradients", "saved")
        return cls(
            inputs=held.get("inputs", 0) + held.get("donated", 0),
            # the GEMM's packing pages, like the arena, are kept for the plan's life
            kept=held.get("scratch", 0) + held.get("constants", 0) + held.get("packing", 0),
            outputs=sum(held.get(c, 0) for c in kinds),
            workspace=max(s.held.get("workspace", 0) for s in peak.steps),
            reused=tuple(
                b.nbytes
                for _, b in peak.buffers
                if b.category in kinds and b.key.startswith("output") and b.nbytes >= REUSE_BYTES
            ),
        )

    def reused_beside(self, leaves) -> int:
        """Bytes of the kept outputs, less those of `leaves` (the gradients the driver writes
        into bucket buffers: their slots are never the workspace's)."""
        left = list(self.reused)
        for leaf in leaves:
            if leaf.nbytes in left:
                left.remove(leaf.nbytes)
        return sum(left)


def _phase(name: str, **held: int) -> RankPhase:
    return RankPhase(name, {k.replace("_", " "): v for k, v in held.items()})


def _wire_dtype(dtype: str, size: int) -> np.dtype:
    """The dtype a bucket packed after the call is summed in (half_sum.py, half_wire.py)."""
    dt = np_dtype(dtype)
    return dt if sent_in_16_bits(dtype, size) else summed_dtype(dt)


def bucket_bytes(layout, in_plan: dict, size: int = 0, node: bool = False) -> tuple[int, int, int]:
    """(bytes of the buckets the driver writes the gradients into, bytes of the buffers packed
    after the call, bytes of the 16-bit copies unpacked from float32 sums) on `size` ranks;
    node: summed in the node's window (small 16-bit buckets summed into float32 buffers there;
    the buckets summed in place there, window_views.summed_in_place, in no buffer of their
    own, 16-bit ones rounded there)."""
    inside = sum(b.nbytes for b in layout.buckets if b.index in in_plan)
    after = [b for b in layout.buckets if b.index not in in_plan]
    if node:
        after = [b for b in after if not summed_in_place(b.dtype, b.nbytes, size)]
    wire = {
        b.index: summed_dtype(np_dtype(b.dtype)) if node else _wire_dtype(b.dtype, size)
        for b in after
    }
    packed = sum(b.nbytes // np_dtype(b.dtype).itemsize * wire[b.index].itemsize for b in after)
    copies = sum(
        leaf.nbytes for b in after if wire[b.index] != np_dtype(b.dtype) for leaf in b.leaves
    )
    return inside, packed, copies


def rounded_buckets(layout, in_plan: dict, size: int, node: bool) -> tuple[int, bool]:
    """(bytes of the float32 sums of the buckets unpacked as 16-bit copies, which nothing
    returned holds once unpacked; whether the loss is such a copy, not an array of its own)."""
    after = [b for b in layout.buckets if b.index not in in_plan]
    if node:  # summed in place: rounded into the window, no float32 sums
        after = [b for b in after if not summed_in_place(b.dtype, b.nbytes, size)]
    sums, loss = 0, False
    for b in after:
        wire = summed_dtype(np_dtype(b.dtype)) if node else _wire_dtype(b.dtype, size)
        if wire != np_dtype(b.dtype):
            sums += b.nbytes // np_dtype(b.dtype).itemsize * wire.itemsize
            loss = loss or any(leaf.index == 0 for leaf in b.leaves)
    return sums, loss


def loss_bytes(layout) -> int:
    return next(leaf.nbytes for b in layout.buckets for leaf in b.leaves if leaf.index == 0)


def allreduce_peak(*facts, into_window: tuple = ()) -> RankPeak:
    """allreduce_call's figures (its arguments, into_window apart) from the loop's third call
    on, with its first call's and, where it differs, its second's. into_window: the gradient
    leaves the plan writes straight into the node's window from the second call on
    (shared_exchange.WindowOutputs): no output buffers of the plan's then (in the second, its
    workspace still keeps the first call's big ones while it runs)."""
    steady = allreduce_call(*facts, into_window=into_window)
    first = allreduce_call(*facts, first=True)
    kept = sum(leaf.nbytes for leaf in into_window if leaf.nbytes >= REUSE_BYTES)
    second = None
    if kept:
        second = allreduce_call(*facts, into_window=into_window, workspace_kept=kept)
    return RankPeak(steady.phases, steady.between, steady.not_counted, first, second)


def allreduce_call(
    layout,
    in_plan: dict,
    plan: PlanFacts,
    params: int,
    update: PlanFacts | None,
    state: int,
    mpi_copies: bool = False,
    size: int = 0,
    window: int = 0,
    into_window: tuple = (),
    first: bool = False,
    workspace_kept: int = 0,
) -> RankPeak:
    """The step that allreduces buckets (data_parallel, with or without an unsharded update).
    The loop keeps the returned gradients (views of the buckets) and loss without an optimizer,
    the loss (an array of its own) with one. mpi_copies: MPI receives each bucket in flight
    into a buffer of its own size (MPICH's recursive doubling, world.ALLREDUCE_ALGORITHM), held
    until the bucket completes; counted as if every bucket were in flight at once after the
    plan (the most it holds: on a busy machine none completes before the step waits). window:
    this rank's segment of the node's shared window (shared_exchange.py), held from the first
    call on. workspace_kept: output buffers of the call before that the plan's workspace
    keeps while the plan runs (the loop's second call: RankPeak.second_call)."""
    inside, packed, copies = bucket_bytes(layout, in_plan, size, node=bool(window))
    in_flight = (inside + packed) if mpi_copies else 0
    loss = loss_bytes(layout)
    batch = plan.inputs - params
    up_kept = update.kept if update is not None else 0
    buckets = inside + packed
    # what the loop still binds: the gradients (views of the buckets, or the 16-bit copies
    # rounded from float32 sums, which then hold no sum) and the loss (its own array, or one
    # of those copies); with an optimizer the loss alone
    rounded, loss_rounded = rounded_buckets(layout, in_plan, size, bool(window))
    loss_own = 0 if loss_rounded else loss
    kept = loss if update is not None else buckets - rounded + copies + loss_own
    kept = 0 if first else kept
    caller = dict(parameters=params, batch=batch, optimizer_state=state, previous_results=kept)
    arenas = dict(plan_arena=plan.kept, update_arena=up_kept, node_window=window)
    # the plan's own output buffers beside the buckets (and beside the window's, written by
    # the plan from the second call on)
    plan_out = plan.outputs - inside - sum(leaf.nbytes for leaf in into_window)
    written = [leaf for b in layout.buckets if b.index in in_plan for leaf in b.leaves]
    reused = plan.reused_beside(written + list(into_window))
    phases = [
        _phase(
            "the plan runs",
            **caller,
            **(arenas | ({"node_window": 0} if first else {})),  # made after the plan, once
            exchange_buffers=inside,
            plan_outputs=plan_out + workspace_kept,
            workspace=plan.workspace,
        )
    ]
    if packed:
        phases.append(
            _phase(
                # in the window the sums go to buffers of their own (shared_exchange.py)
                "the buckets are summed after the call"
                if window
                else "the buckets are packed after the call",
                **caller,
                **arenas,
                exchange_buffers=buckets,
                plan_outputs=plan_out,
            )
        )
    if in_flight:
        phases.append(
            _phase(
                "the allreduces are in flight",
                **caller,
                **arenas,
                exchange_buffers=buckets,
                plan_outputs=plan_out,
                MPI_buffers=in_flight,
            )
        )
    after = dict(**caller, **arenas, exchange_buffers=buckets + copies, plan_outputs=reused)
    if update is not None:
        phases.append(
            _phase(
                "the update runs",
                **after,
                loss=loss_own,
                update_outputs=update.outputs,
                workspace=update.workspace,
            )
        )
    else:
        phases.append(_phase("the sums are unpacked", **after, loss=loss_own))
    # between calls the loop holds this call's results in place of the last ones; the driver
    # keeps its bucket buffers (reused when the loop holds no gradient of them), the plan's
    # workspace its big outputs
    between = _phase(
        "between calls",
        **caller,
        **arenas,
        exchange_buffers=inside if update is not None else 0,
        plan_outputs=reused,
        # the update's workspace keeps its big outputs of the call before the loop's (which
        # the loop let go) to write the next call's into: no new ones then
        update_outputs=sum(update.reused) if update is not None and not first else 0,
    )
    mine = ("batch", "workspace", "node window")
    if first:  # the caller's own parameters and state; from call 2 the update's outputs
        mine = ("parameters", "optimizer state", *mine)
    if update is None:
        mine = ("parameters", *NOT_COUNTED)
    return RankPeak(tuple(phases), between, mine)


def sharded_peak(
    groups,
    rank: int,
    loss_dtype,
    plan: PlanFacts,
    update: PlanFacts,
    state: int,
    ranges,
    window: int = 0,
    into_window: tuple = (),
) -> RankPeak:
    """The ZeRO-1 step (sharding.ShardedExchange): per dtype a send buffer of every rank's
    slot, this rank's receive slot and two all-gather buffers (the one the parameters passed in
    are views of, counted as parameters, and the one this call fills) kept between calls, and
    a padded range when a rank owns fewer elements than a block. ranges: the bytes of this
    rank's updated range of each dtype, which the update's workspace keeps after the
    all-gather has sent them (the big ones, codegen/run/workspace.py). into_window: the
    gradient leaves the plan writes straight into the window's send buffers from the second
    call on (sharded_outputs.py): no output buffers of the plan's own then."""
    loss_dt = np.dtype(loss_dtype)
    size = groups[0].size if groups else 1
    pool = params = 0
    copies = 0  # 16-bit ranges rounded from their float32 sums: copies the update reads
    for k, group in enumerate(groups):
        summed = summed_dtype(group.dtype).itemsize
        stride = group.block + (k == 0 and group.dtype == loss_dt)
        gathered = group.block * size * group.dtype.itemsize
        params += gathered
        # the send buffer lives in the node's window when there is one (shared_sharding.py)
        pool += (0 if window else stride * size * summed) + stride * summed + gathered
        lo, hi = group.owned(rank)
        if hi - lo != group.block and not window:  # (in the window: padded there)
            pool += group.block * group.dtype.itemsize  # "range sent", padded to a block
        if summed_dtype(group.dtype) != group.dtype:
            copies += group.block * group.dtype.itemsize
    loss = loss_dt.itemsize
    given = sum(g.total * g.dtype.itemsize for g in groups)  # the caller's own parameters
    batch = plan.inputs - given
    written = sum(leaf.nbytes for leaf in into_window)

    def phases(first: bool) -> tuple:
        """The call's phases; the first call holds the caller's own parameters and nothing
        from a previous call, and makes the pool and the window at its exchange."""
        caller = dict(
            parameters=given if first else params,
            batch=batch,
            optimizer_state=state,
            previous_results=0 if first else loss,
        )
        common = dict(
            **caller,
            plan_arena=plan.kept,
            update_arena=update.kept,
            node_window=window,
            exchange_buffers=pool,
        )
        before = common | ({"node_window": 0, "exchange_buffers": 0} if first else {})
        outputs = plan.outputs - (0 if first else written)
        reused = sum(plan.reused) if first else plan.reused_beside(into_window)
        return (
            _phase("the plan runs", **before, plan_outputs=outputs, workspace=plan.workspace),
            _phase("the reduce-scatter is packed", **common, plan_outputs=outputs, loss=loss),
            _phase(
                "the update of this rank's share runs",
                **common,
                plan_outputs=reused,
                loss=loss + copies,
                update_outputs=update.outputs,
                workspace=update.workspace,
            ),
        )

    steady = phases(False)
    kept_ranges = sum(n for n in ranges if n >= REUSE_BYTES)
    common = {k: n for k, n in steady[0].held.items() if k not in ("plan outputs", "workspace")}
    between = RankPhase(
        "between calls",
        common
        | {
            "plan outputs": plan.reused_beside(into_window),
            # the update's big outputs of the call before the loop's (its ranges and state),
            # kept by its workspace to write the next call's into
            "update outputs": max(kept_ranges, sum(update.reused)),
        },
    )
    first = RankPeak(phases(True), between, ("parameters", "optimizer state", *NOT_COUNTED))
    return RankPeak(steady, between, first_call=first)
