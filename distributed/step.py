"""data_parallel: run the joint plan on this rank's shard, then add up the loss and gradients of
all ranks bucket by bucket, in the order the plan finishes them."""

from __future__ import annotations

from math import inf

import numpy as np

from backplan.codegen.build import driver_tier
from backplan.codegen.run.memory_check import checking
from backplan.runtime import is_grad_enabled
from backplan.runtime.backend import current_backend
from backplan.tracer.fastpath import call_key, guard_for, positions_of
from backplan.tracer.functional import GradFunction, ValueAndGradFunction, joint_reader
from backplan.tracer.pytree import flatten, unflatten
from backplan.tracer.tensor import Tensor

from .accumulation import Accumulator
from .agreement import check_replicas as verify_replicas
from .agreement import (
    describe_batch,
    fingerprint,
    leaf_array,
    require_same_trees,
    settings_difference,
)
from .buckets import DEFAULT_BUCKET_BYTES
from .deadline import roll_call, wait_or_raise
from .errors import RankFailedError, RankMismatchError, RankOutOfStepError
from .exchange import Exchange
from .failure import (
    BEFORE_AGREEMENT,
    DIVERGED,
    describe_error,
    failed_text,
    out_of_step_text,
    raise_for_others,
    settle,
    settle_seconds,
)
from .in_plan import InPlanExchange
from .layout import Layout, build_layout
from .node_agreement import NodeAgreement
from .rank_peak import PlanFacts, allreduce_peak
from .report import DataParallelReport
from .rows import batch_lengths, lengths_digest, row_weights
from .segments import run_segments, split_plan
from .sharded_outputs import ShardedWindowOutputs
from .shared_exchange import (
    SharedExchange,
    WindowOutputs,
    node_agreement,
    previewed,
    reduction,
    window_bytes,
)
from .training import DataParallelTraining
from .world import World, current_world, init, mpi_module, sums_by_recursive_doubling

LOWEST = np.iinfo(np.int64).min  # a failed rank's agreement numbers: below any rank's
FAILED, DIVERGED_KIND = 1, 2  # the agreement's fifth number: this call failed; out of step
OUTSIDE, KIND = 5, 6  # the agreement's sixth number (buckets started after the call); the kind
SETTINGS_FIX = (
    "every rank must call a step made with the same shard_optimizer, average and accumulate"
)
BATCH_FIX = (
    "every rank must pass the arguments not differentiated (the batch) with the same "
    "structure, dtypes and shapes beyond the first axis (the rows, which may differ)"
)
MISMATCH_FIX = (
    "every rank must differentiate parameters of the same structure, shapes and dtypes "
    "(start them all from bpd.broadcast(params)) with the same bucket_bytes"
)


class DataParallelStep:
    """A training step over all ranks; see data_parallel."""

    def __init__(
        self,
        fn,
        *,  # by name: three of them are booleans a reordering would swap silently
        average,
        bucket_bytes,
        check_replicas,
        split_plan,
        comm,
        timeout,
        accumulate=1,
        overlap=True,
    ):
        if not isinstance(fn, ValueAndGradFunction) or isinstance(fn, GradFunction):
            raise TypeError(
                "data_parallel needs the training step as bp.value_and_grad(loss_fn), whose "
                f"joint plan says when each gradient is ready; got {type(fn).__name__}"
            )
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        if timeout is not None and not (isinstance(timeout, int | float) and 0 < timeout < inf):
            raise ValueError(f"timeout must be positive seconds or None, got {timeout!r}")
        if not isinstance(accumulate, int) or isinstance(accumulate, bool) or accumulate < 1:
            raise ValueError(f"accumulate must be a whole number of calls >= 1, got {accumulate!r}")
        if accumulate > 1 and split_plan:
            raise ValueError(
                "data_parallel(accumulate=k) exchanges the summed gradients once per k calls, "
                "after the k-th call's plan has run; split_plan=True (an exchange inside the "
                "plan) does not combine with it"
            )
        self.fn = fn
        self.average = average
        self.bucket_bytes = bucket_bytes
        self.check_replicas = check_replicas
        self.split_plan = split_plan
        self._comm = comm
        self.timeout = timeout
        self.accumulate = accumulate
        self.overlap = overlap
        self.sharded = False  # set by a ZeRO-1 training step, whose exchange is its own
        self._in_plans: dict = {}  # id(joint trace) -> (joint trace, InPlanExchange)
        self._window_outputs: dict = {}  # id(joint trace) -> (joint trace, WindowOutputs)
        self._accumulator = Accumulator(accumulate)
        self._layouts: dict = {}
        self._segments: dict = {}  # id(joint trace) -> (joint trace, segments)
        # call key -> (joint trace, positions of its inputs among the leaves, their reader)
        self._inputs: dict = {}
        self._called: set = set()  # call keys this step ran: wait_for_driver traces no other
        self._asked: dict = {}  # id(joint trace) -> (it, its plan): the plan's driver asked for
        self._out_of_step: str | None = None  # failure.py: why this rank cannot call again
        self._diverged: str | None = None  # an unsharded update raised here (training.py)
        self._reduction: str | None = None  # reduction(world), once known
        self.windows: dict = {}  # key -> node_window.NodeWindow: this step's, freed with it
        self._kinds: dict = {}  # _settings' values -> their fingerprint (_kind)
        self._last_key: tuple | None = None  # (the last new call key, its fastpath guard)
        self._lengths: dict = {}  # call key -> rows.batch_lengths of its arguments

    def __call__(self, *args, **kwargs):
        world = init(self._comm)
        if world.size == 1 and self.accumulate == 1:
            return self.fn(*args, **kwargs)
        exchange, loss, aux = self.started(args, kwargs, Exchange)
        if exchange is None:  # accumulating: no gradients yet
            return ((loss, aux), None) if self.fn.has_aux else (loss, None)
        summed = exchange.finish()
        loss, grads = summed[0], unflatten(exchange.layout.grad_treedef, summed[1:])
        return ((loss, aux), grads) if self.fn.has_aux else (loss, grads)

    def started(self, args, kwargs, exchange_type):
        """Run this rank's plan and start the exchange of its loss and gradients with an
        exchange_type (Exchange, or ShardedExchange for ZeRO-1). Returns (the exchange, None,
        aux), or, while accumulating micro-batches, (None, this rank's loss, aux). A call that
        raises after the ranks agreed on it completes its exchange first, one that raises
        before tells the others in the agreement (failure.py)."""
        world = init(self._comm)
        if self._out_of_step is not None:
            raise RankOutOfStepError(self._out_of_step)
        exchanging = self._accumulator.last_of_round
        if exchanging:
            self._check_arrival(world, args)
            self.reduction(world)  # collective in the first: every rank is here (the roll call)
        if self._diverged is not None:
            self._tell_diverged(world, exchanging)
        if exchanging and self._accumulator.failure is not None:  # an earlier call raised
            self._round_failed(world)
        exchange = lengths = None
        try:
            key, leaves = self._call_key(args, kwargs)
            layout = self._layout(args, kwargs, key)
            if exchange_type is Exchange and self._reduction == "shared":
                exchange_type = SharedExchange
            exchange = exchange_type(world, layout, self.average, self.timeout)
            exchange.node = self._reduction == "shared"  # ZeRO-1's through the window too
            exchange.windows, exchange.step_name = self.windows, _name(self.fn)
            exchange.agreement, exchange.agreed, exchange.in_driver = None, False, None
            exchange.posted = exchange.inside = exchange.all_inside = False
            exchange.accumulated = self.accumulate > 1
            lengths = self._batch_lengths(args, kwargs, key)
            return self._run(world, args, kwargs, key, leaves, exchange, lengths, exchange_type)
        except BaseException as error:
            if exchange is None or not exchange.posted:
                self._failed_before_agreement(world, error, exchanging)
            else:
                self._failed(world, exchange, error, lengths, args, kwargs)
            raise

    def _call_key(self, args, kwargs) -> tuple:
        """fastpath.call_key's (key, leaves), the last call's key again when its guard matches
        (a few comparisons per leaf instead of building and hashing a key)."""
        grad_enabled = is_grad_enabled()
        last = self._last_key  # read once: another thread may replace it
        if last is not None:
            leaves = last[1](args, kwargs, grad_enabled)
            if leaves is not None:
                return last[0], leaves
        key, leaves = call_key(args, kwargs, grad_enabled)
        if key is not None:
            self._called.add(key)
            self._last_key = (key, guard_for(key))
        return key, leaves

    def _batch_lengths(self, args, kwargs, key) -> tuple[int, ...]:
        """rows.batch_lengths, once per call key (whose shapes it is read from)."""
        found = self._lengths.get(key) if key is not None else None
        if found is None:
            found = batch_lengths(args, kwargs, self.fn.argnums)
            if key is not None:
                self._lengths[key] = found
        return found

    def _run(self, world, args, kwargs, key, leaves, exchange, lengths, exchange_type):
        """started's work once the call's exchange exists: agree, run the plan, start."""
        layout = exchange.layout
        if self.split_plan:
            self._agreed(exchange, self._agree(world, exchange, lengths, args, kwargs))
            return exchange, None, self._run_split(args, kwargs, key, leaves, exchange)
        in_plan = None
        if exchange_type is Exchange and self.accumulate == 1:  # MPI's allreduce
            in_plan = self._in_plan(world, args, kwargs, key, leaves, layout)
        if in_plan is not None:
            exchange.inside = True
            self._agreed(exchange, self._agree(world, exchange, lengths, args, kwargs))
            # equal shards, and every rank's driver starts its buckets: a rank whose hooked
            # driver is still building starts them all after its call in bucket order, which
            # MPI would pair with this rank's driver order (other buckets summed together)
            if exchange.weight is None and exchange.all_inside:
                exchange.in_driver = in_plan
                return (
                    exchange,
                    None,
                    self._run_in_plan(in_plan, args, kwargs, key, leaves, exchange),
                )
        # a call whose buckets start after it posts its agreement before the plan runs and waits
        # for it after: the ranks post it together, so the wait finds the others' message there
        # instead of being one more meeting point after the plan (which met the slower rank's
        # compute; ZeRO-1's reduce-scatter and all-gather then met it twice more). Accumulating,
        # the k-th call agrees after adding: a round failing its checks posts nothing
        if in_plan is None and self.accumulate == 1:
            exchange.agreement = self._agree_start(world, layout, lengths, exchange)
        if not self.overlap or exchange_type is not Exchange or self.accumulate > 1:
            self._compile_plan_driver(args, kwargs, key, leaves)
        placed = None
        if self.accumulate == 1 and self._reduction == "shared":
            if exchange_type is SharedExchange or self.sharded:
                placed = self._run_into_window(world, args, kwargs, key, leaves, exchange)
        if placed is not None:
            arrays, aux = placed
        else:
            result = self.fn(*args, **kwargs)
            (loss, aux), grads = result if self.fn.has_aux else ((result[0], None), result[1])
            arrays = [leaf_array(loss)] + [leaf_array(g) for g in flatten(grads)[0]]
        if self.accumulate > 1:
            arrays = self._accumulator.add(layout.fingerprint, lengths, arrays)
            if arrays is None:
                return None, loss, aux
        if exchange.agreement is not None:
            self._finish_agreement(world, exchange, lengths, args, kwargs)
        elif in_plan is None:
            self._agreed(exchange, self._agree(world, exchange, lengths, args, kwargs))
        exchange.start(lambda index: arrays[index])
        return exchange, None, aux

    @staticmethod
    def _agreed(exchange, weights) -> None:
        """Note the call agreed; weights: every rank's share of the rows (None: equal)."""
        exchange.weights, exchange.agreed = weights, True
        exchange.weight = None if weights is None else weights[exchange.world.rank]

    def _finish_agreement(self, world, exchange, lengths, args, kwargs) -> None:
        """Wait for the agreement the call posted early (_agree_finish) and note it done."""
        agreeing, exchange.agreement = exchange.agreement, None  # waited for once, come what may
        weights = self._agree_finish(world, exchange.layout, agreeing, lengths, args, kwargs)
        self._agreed(exchange, weights)

    def _failed(self, world, exchange, error, lengths, args, kwargs) -> None:
        """This rank's call raised `error` after posting its agreement (or after the agreement):
        complete the call's exchange with NaN so the other ranks raise RankFailedError and all
        stay in step (failure.settle); where the compiled driver had started the exchange, or
        completing it fails, the step is out of step and its next call says so."""
        if exchange.agreement is None and not exchange.agreed:
            return  # the agreement itself failed alike on every rank (or timed out)
        why = "the compiled step had started part of that call's exchange itself"
        try:
            first = []
            if exchange.in_driver is not None:
                first = exchange.in_driver.unstarted(getattr(exchange, "table", None))
            if first is not None:
                if exchange.agreement is not None:
                    exchange.timeout = settle_seconds(exchange.timeout)
                    try:
                        self._finish_agreement(world, exchange, lengths, args, kwargs)
                    except RankFailedError:
                        return  # another rank failed before the agreement: nothing moved
                settle(exchange, error, first)
                error.add_note(
                    f"backplan.distributed: rank {world.rank} completed this call's exchange "
                    "with NaN in place of its gradients, so the other ranks raised "
                    "RankFailedError and no rank applied anything from the call: the step "
                    "may be called again"
                )
                return
        except BaseException as settling:
            why = f"completing that call's exchange raised {describe_error(settling)}"
            self._out_of_step = out_of_step_text(world, error, _name(self.fn), why=why)
            error.add_note(f"backplan.distributed: {self._out_of_step}")
            return
        self._out_of_step = out_of_step_text(world, error, _name(self.fn), why=why)

    def _failed_before_agreement(self, world, error, exchanging: bool) -> None:
        """This rank's call raised before posting its agreement (tracing, its checks, a
        micro-batch's plan). On a call the ranks agree on, post the agreement marked failed,
        so the others raise RankFailedError and all stay in step; on an earlier call of an
        accumulating round (no MPI call on any rank), count it: the round's last call tells."""
        if not exchanging:
            self._accumulator.failed(describe_error(error))
            error.add_note(
                f"backplan.distributed: rank {world.rank} counted this call as call "
                f"{self._accumulator.calls} of its round of accumulate={self.accumulate}; at "
                "the round's last call every rank raises RankFailedError and drops the round"
            )
            return
        self._accumulator.drop()
        try:
            self._tell_others(world, describe_error(error))
        except BaseException as telling:
            self._out_of_step = out_of_step_text(world, error, _name(self.fn), telling)
            error.add_note(f"backplan.distributed: {self._out_of_step}")
            return
        error.add_note(
            f"backplan.distributed: rank {world.rank} raised before the ranks agreed on this "
            "call and told the other ranks in the agreement (they raised RankFailedError); "
            "nothing moved: the step may be called again"
        )

    def _tell_others(self, world, failure: str, kind: int = FAILED) -> list:
        """Post this call's agreement marked failed (kind: FAILED, or DIVERGED_KIND) and wait
        for it (settle_seconds at most): every rank then gathers what failed where
        (failure.raise_for_others)."""
        _, _, request = self._agree_start(world, None, None, failed=kind)
        wait_or_raise(request, settle_seconds(self.timeout), "the agreement of the step's layouts")
        when = DIVERGED if kind == DIVERGED_KIND else BEFORE_AGREEMENT
        return raise_for_others(world, failure, _bare_name(self.fn), when)

    def _tell_diverged(self, world, exchanging: bool) -> None:
        """This rank's unsharded update raised in an earlier call: on every call that meets
        the others, tell them (they raise RankFailedError), and raise RankOutOfStepError."""
        if exchanging:
            self._tell_others(world, self._diverged, DIVERGED_KIND)
        text = DIVERGED.format(name=_name(self.fn))
        raise RankOutOfStepError(
            f"this rank ({world.rank} of {world.size}) raised {self._diverged} {text}"
        )

    def _round_failed(self, world) -> None:
        """The last call of an accumulating round in which this rank's earlier call raised:
        tell the others (they raise RankFailedError too) and raise it here as well."""
        failure = self._accumulator.drop()
        try:
            failed = self._tell_others(world, failure)
        except BaseException as telling:
            self._out_of_step = out_of_step_text(world, telling, _name(self.fn), telling)
            raise
        name = _bare_name(self.fn)
        raise RankFailedError(failed_text(failed, world.size, name, BEFORE_AGREEMENT))

    def _in_plan(self, world, args, kwargs, key, leaves, layout) -> InPlanExchange | None:
        """The exchange inside the compiled step for this signature, when it applies: overlap
        on, the compiled backend with its kernels built, a driver it can hook, compiled (in a
        background process under BACKPLAN_DRIVER=background: until then, None)."""
        if not self.overlap or current_backend() != "numba" or checking():
            return None
        entry = self._joint_inputs(args, kwargs, key, leaves, arrays=False)
        found = self._in_plans.get(id(entry))
        if found is None:
            compiled = getattr(entry.runner(), "compiled", None)
            if not _hookable(compiled):
                return None  # kernels still building, or drivers kept Python: ask next call
            found = self._in_plans[id(entry)] = (
                entry,
                InPlanExchange(compiled, layout, world.comm),
            )
        in_plan = found[1]
        if not in_plan.active:
            return None
        ready = in_plan.ready(lambda: self._joint_inputs(args, kwargs, key, leaves)[1])
        return in_plan if ready else None

    def _compile_plan_driver(self, args, kwargs, key, leaves) -> None:
        """A step that never starts buckets inside its driver (ZeRO-1, overlap=False,
        accumulate) runs the plan's own driver: ask for it compiled where BACKPLAN_DRIVER=
        background kept it Python as saving under 5% of a step. Every rank waits for the
        slowest plan, and the overlapped step runs compiled: the bench transformer's ZeRO-1
        step spent 5.3 ms CPU more than it, 3.4 of them in the Python-run driver."""
        if current_backend() != "numba" or checking():
            return
        entry = self._joint_inputs(args, kwargs, key, leaves, arrays=False)
        if id(entry) in self._asked:
            return
        compiled = getattr(entry.runner(), "compiled", None)
        if compiled is None or compiled.driver_tier == "reference":
            return  # kernels still building: ask next call
        self._asked[id(entry)] = (entry, compiled)
        if compiled.driver_skipped:
            compiled.build_skipped_driver(self._joint_inputs(args, kwargs, key, leaves)[1])

    def wait_for_driver(self, *args, timeout: float | None = None, **kwargs) -> bool:
        """Wait until the calls with these arguments run the driver that starts the allreduces
        itself (compiled in a background process under BACKPLAN_DRIVER=background, after the
        first call asked for it); True once they do, False when they start every bucket after
        the call (overlap=False, the reference backend, no bucket it can start, a failed
        build) or the timeout passed. A step that starts its buckets after the call (ZeRO-1,
        overlap=False) first waits for the plan's own compiled driver it asked for (see
        _compile_plan_driver). Benchmarks call it before timing."""
        key, leaves = call_key(args, kwargs, is_grad_enabled())
        if key is not None and key not in self._called:
            return False  # a question: a trace at a new size would replace the built entry
        entry = self._joint_inputs(args, kwargs, key, leaves, arrays=False)
        asked = self._asked.get(id(entry))
        if asked is not None:  # the plan's own driver, compiled for this step: wait for it
            asked[1].wait_for_driver(timeout)
        found = self._in_plans.get(id(entry))
        if found is None or not found[1].active:
            return False
        return found[1].loaded or found[1].wait_built(timeout)

    def _run_into_window(self, world, args, kwargs, key, leaves, exchange):
        """(this rank's loss and gradients, the aux outputs) of the compiled joint plan with
        the gradients written straight into the node window's buffers of this call
        (shared_exchange.WindowOutputs), or None to call the plan as usual. The checked mode
        runs it too (counting what the call holds), so that it measures what runs unchecked.
        Tells the exchange which buckets need no packing (SharedExchange.in_window)."""
        if not self.overlap or current_backend() != "numba":
            return None
        layout = exchange.layout
        entry = self._joint_inputs(args, kwargs, key, leaves, arrays=False)
        found = self._window_outputs.get(id(entry))
        if found is None:
            compiled = getattr(entry.runner(), "compiled", None)
            if compiled is None or compiled.driver_tier == "reference":
                return None  # kernels still building: ask next call
            written = self._window_outputs_of(compiled, layout, world.size)
            found = self._window_outputs[id(entry)] = (entry, written)
        entry, arrays = self._joint_inputs(args, kwargs, key, leaves)
        outputs = found[1].run(self.windows, layout, arrays)
        if outputs is None:
            return None
        exchange.in_window = found[1].written  # buckets, or with ZeRO-1 parameter positions
        positions = layout.output_positions
        mine = [outputs[positions[index]] for index in range(layout.n_leaves)]
        if not self.fn.has_aux:
            return mine, None
        aux = [Tensor._from_array(a) for a in outputs[1 : 1 + entry.n_aux]]
        return mine, unflatten(entry.aux_treedef, aux)

    def _run_in_plan(self, in_plan, args, kwargs, key, leaves, exchange):
        """Run the hooked driver, start the buckets it could not, return the aux outputs."""
        entry, arrays = self._joint_inputs(args, kwargs, key, leaves)
        outputs = in_plan.run(exchange, arrays)
        positions = exchange.layout.output_positions
        exchange.start_rest(lambda index: outputs[positions[index]])
        if not self.fn.has_aux:
            return None
        aux = [Tensor._from_array(a) for a in outputs[1 : 1 + entry.n_aux]]
        return unflatten(entry.aux_treedef, aux)

    def _check_arrival(self, world: World, args) -> None:
        if self.timeout is not None:
            roll_call(world.comm, self.timeout, f"the data-parallel step of {_name(self.fn)}")
        if self.check_replicas:
            verify_replicas(self._differentiated(args), world.comm)

    def _window_outputs_of(self, compiled, layout, size: int):
        """What the plan writes into the node's window: the buckets (WindowOutputs), or with
        ZeRO-1 the send buffers (ShardedWindowOutputs)."""
        if self.sharded:
            return ShardedWindowOutputs(compiled, layout, size)
        return WindowOutputs(compiled, layout)

    def _run_split(self, args, kwargs, key, leaves, exchange: Exchange):
        """Run the joint plan segment by segment, starting each bucket's allreduce after the
        segment that finishes it; returns the aux outputs (has_aux) or None."""
        entry, arrays = self._joint_inputs(args, kwargs, key, leaves)
        segments = self._segments_of(entry, exchange.layout)
        outputs = entry.plan.graph.outputs
        positions = exchange.layout.output_positions

        def after_segment(segment, env):
            exchange.progress()
            exchange.start_ready(segment.last_step, lambda x: env[outputs[positions[x.index]]])

        results = run_segments(segments, entry.plan, arrays, after_segment)
        if not self.fn.has_aux:
            return None
        aux = [Tensor._from_array(a) for a in results[1 : 1 + entry.n_aux]]
        return unflatten(entry.aux_treedef, aux)

    def _joint_inputs(self, args, kwargs, key, leaves, arrays=True):
        """The joint trace and its input arrays, as value_and_grad would pass them; after the
        first call of a signature without binding it again (as value_and_grad's fast path).
        arrays=False: the joint trace alone."""
        hit = self._inputs.get(key) if key is not None else None
        if hit is not None:
            entry, positions, read = hit
            if not arrays:
                return entry
            picked = [leaves[i] for i in positions]
            data = read(picked, current_backend() == "reference")
            return entry, data + [t._data for t in entry.captured]
        bound, entry = self.fn.lookup(args, kwargs)
        call = bound.call
        if key is not None:  # tensors, NumPy arrays and floats: read as value_and_grad's
            positions = positions_of([call.sources[p] for p in call.tensor_positions], leaves)
            if positions is not None:
                read = joint_reader(entry, [leaves[i] for i in positions])
                self._inputs[key] = (entry, positions, read)
        if not arrays:
            return entry
        tensors = [call.leaves[p] for p in call.tensor_positions]
        return entry, [t._data for t in tensors] + [t._data for t in entry.captured]

    def _segments_of(self, entry, layout: Layout):
        found = self._segments.get(id(entry))
        if found is None:
            cuts = [bucket.ready_step for bucket in layout.buckets]
            found = self._segments[id(entry)] = (entry, split_plan(entry.plan, cuts))
        return found[1]

    def layout(self, args, kwargs=None) -> Layout:
        """The buckets for these arguments' signature (cached per signature)."""
        kwargs = kwargs or {}
        return self._layout(args, kwargs, call_key(args, kwargs, is_grad_enabled())[0])

    def _layout(self, args, kwargs, key) -> Layout:
        found = self._layouts.get(key) if key is not None else None
        if found is None:
            found = build_layout(self.fn, args, kwargs, self.bucket_bytes)
            if key is not None:
                self._layouts[key] = found
        return found

    def explain(self, *args, size: int | None = None, **kwargs) -> DataParallelReport:
        """The buckets, when each allreduce may start, when it starts and is waited on, and the
        bytes each rank sends per step; traces but runs nothing and needs no MPI. size: the
        ranks to preview; by default those of the world bpd.init() found when there are
        several, else 2 (a script run without mpiexec is one rank, which exchanges nothing),
        and the report says so and how to preview N ranks."""
        size, note = preview_size(size, current_world())
        layout = self.layout(args, kwargs)
        shared = previewed(self._reduction, size) == "shared"
        report = DataParallelReport(
            layout,
            size,
            self.bucket_bytes,
            self.split_plan,
            self.accumulate,
            starts := {} if shared else self._in_plan_starts(args, kwargs, layout, size),
        )
        report.size_note = note
        if shared:
            report.summed_in_window()
        report.driver_note = None if shared else self._driver_note(args, kwargs, starts)
        if self.counts_rank_peak():
            report.rank_peak = allreduce_peak(
                layout,
                starts,
                self.plan_facts(args, kwargs),
                self.param_bytes(args),
                None,
                0,
                not shared and sums_by_recursive_doubling(size),
                size,
                window_bytes(layout, size) if shared else 0,
                into_window=self.window_leaves(args, kwargs, layout, size) if shared else (),
            )
        return report

    def counts_rank_peak(self) -> bool:
        """Whether explain counts the per-rank peak (rank_peak.py): for the compiled backend's
        steps that exchange every call in one plan (not split_plan, not accumulate)."""
        return current_backend() == "numba" and not self.split_plan and self.accumulate == 1

    def plan_facts(self, args, kwargs) -> PlanFacts:
        """The joint plan's call at its peak (the highest of the plans its calls run)."""
        return PlanFacts.of(self.fn.explain(*args, **kwargs).call_peak)

    def param_bytes(self, args) -> int:
        return sum(leaf_array(x).nbytes for x in flatten(self._differentiated(args))[0])

    def _in_plan_starts(self, args, kwargs, layout, size: int) -> dict:
        """bucket index -> (plan step, calls in flight) for the buckets the compiled driver
        would start itself (InPlanExchange.start_of); empty when the step starts them after
        the call (overlap=False, split_plan, accumulate, ZeRO-1, the reference backend,
        BACKPLAN_DRIVER=python). While the driver builds in the background the step starts
        them after the call; the report shows what it does once the driver is compiled (and
        its driver_note says so)."""
        if not self.overlap or self.split_plan or self.accumulate > 1 or self.sharded:
            return {}
        if current_backend() != "numba" or checking():
            return {}
        entry = self.fn.lookup(args, kwargs)[1]
        compiled = getattr(entry.runner(), "compiled", None)
        if not _hookable(compiled):
            return {}
        preview = InPlanExchange(compiled, layout, None, size)
        starts = {b.index: preview.start_of(entry.plan, b.index) for b in layout.buckets}
        return {k: v for k, v in starts.items() if v is not None}

    def window_leaves(self, args, kwargs, layout, size: int) -> tuple:
        """The gradient leaves the compiled plan writes straight into the node window from the
        step's second call on (shared_exchange.WindowOutputs, with ZeRO-1 on `size` ranks
        sharded_outputs.ShardedWindowOutputs: no output buffer of the plan's own then); none
        where the step calls the plan as usual (see _run_into_window)."""
        if not self.overlap or self.split_plan or self.accumulate > 1:
            return ()
        if current_backend() != "numba":
            return ()
        compiled = getattr(self.fn.lookup(args, kwargs)[1].runner(), "compiled", None)
        if compiled is None or compiled.driver_tier == "reference":
            return ()
        if self.sharded:
            return tuple(ShardedWindowOutputs(compiled, layout, size).leaves)
        buckets = WindowOutputs(compiled, layout).buckets
        return tuple(leaf for bucket in buckets for leaf in bucket.leaves)

    def _driver_note(self, args, kwargs, starts: dict) -> str | None:
        """What explain adds when the driver that starts the buckets is not running yet (or
        never will: BACKPLAN_DRIVER=python)."""
        mode = driver_tier.driver_mode()
        if not self.overlap or self.split_plan or self.accumulate > 1 or self.sharded:
            return None
        if not starts:
            if mode == "python" and current_backend() == "numba":
                return (
                    "BACKPLAN_DRIVER=python runs every plan's driver as Python, which starts "
                    "no allreduce: each bucket starts after the call returns."
                )
            return None
        found = self._in_plans.get(id(self.fn.lookup(args, kwargs)[1]))
        if mode != "background" or (found is not None and found[1].loaded):
            return None
        return (
            "Under BACKPLAN_DRIVER=background this driver, with the allreduces inside, is "
            "compiled in a background process after the first call (seconds, once: then from "
            "the disk cache), also when the plan's own driver stays Python because a compiled "
            "one would save under 5% of a step; calls until it is loaded run the plan's driver "
            "and start every bucket after the call returns, and so do every rank's calls "
            "until every rank has loaded its own (the ranks start their buckets in one order). "
            "step.wait_for_driver(*args) waits for it."
        )

    def _differentiated(self, args):
        nums = self.fn.argnums
        return args[nums] if isinstance(nums, int) else tuple(args[i] for i in nums)

    def _agree(self, world: World, exchange, lengths, args, kwargs) -> list[float] | None:
        """One 64-byte maximum over the ranks per call (MPI's allreduce, or on one node the
        communicator's agreement window, node_agreement.py): max of (fingerprint, -fingerprint)
        equals this rank's own pair on every rank only when all fingerprints are equal; the
        same for the digest of the batch arguments' lengths and for the step's kind (exchange,
        average, accumulate).
        On a mismatch every rank gathers what differs and raises the same error, before any
        gradient moves. Returns every rank's share of the global batch when ranks hold different
        numbers of rows (None when all hold the same). The fifth number says whether a rank
        failed before agreeing (_failed_before_agreement); the sixth whether a rank starts its
        buckets after its call (exchange.all_inside: whether every rank's driver starts them,
        in the driver's order)."""
        agreeing = self._agree_start(world, exchange.layout, lengths, exchange)
        weights = self._agree_finish(world, exchange.layout, agreeing, lengths, args, kwargs)
        exchange.all_inside = not agreeing[1][OUTSIDE]
        return weights

    def _agree_start(self, world: World, layout, lengths, exchange=None, failed=False) -> tuple:
        """Post the agreement's allreduce (non-blocking); _agree_finish waits for it. failed:
        this rank's call raised before agreeing (its numbers lowest, so they change no max)."""
        if failed:
            mine = np.array([LOWEST] * 4 + [int(failed)] + [LOWEST] * 3, np.int64)
        else:
            digest = lengths_digest(lengths)
            kind = self._kind(exchange)
            outside = not getattr(exchange, "inside", False)
            mine = [layout.fingerprint, -layout.fingerprint, digest, -digest, 0, outside, kind]
            mine = np.array(mine + [-kind], np.int64)
        if exchange is not None:
            exchange.posted = True
        highest = np.empty_like(mine)
        window = node_agreement(world.comm)
        if window is not None:  # ranks on one node: through shared memory, no MPI call
            return mine, highest, NodeAgreement(window, mine, highest)
        return mine, highest, world.comm.Iallreduce(mine, highest, op=mpi_module().MAX)

    def _agree_finish(self, world: World, layout: Layout, agreeing, lengths, args, kwargs):
        """Wait for the agreement _agree_start posted and act on it (see _agree)."""
        mine, highest, request = agreeing
        if self.timeout is None:
            request.Wait()
        else:
            wait_or_raise(request, self.timeout, "the agreement of the step's layouts")
        highest, mine = highest.tolist(), mine.tolist()  # 8 numbers: compared as Python ints
        if highest[4]:
            when = DIVERGED if highest[4] == DIVERGED_KIND else BEFORE_AGREEMENT
            raise_for_others(world, None, _bare_name(self.fn), when)
        if highest[:2] != mine[:2]:
            batch = describe_batch(args, kwargs, self.fn.argnums)
            require_same_trees(world.comm, batch, "", BATCH_FIX)
            require_same_trees(world.comm, layout.description(), "", MISMATCH_FIX)
            raise RankMismatchError(
                f"ranks split the gradients into buckets differently (this rank, {world.rank}: "
                f"bucket_bytes={self.bucket_bytes}, {len(layout.buckets)} buckets); "
                f"{MISMATCH_FIX}"
            )
        if highest[KIND:] != mine[KIND:]:
            raise RankMismatchError(
                f"{settings_difference(world.comm.allgather(self._settings(None)))}; {SETTINGS_FIX}"
            )
        if highest[2:4] == mine[2:4] or not self.average:
            return None
        return row_weights(world.comm, lengths, args, kwargs, self.fn.argnums)

    def _kind(self, exchange) -> int:
        """The fingerprint of _settings (hashed once per set of settings, not per call)."""
        settings = self._settings(exchange)
        values = tuple(settings.values())
        found = self._kinds.get(values)
        if found is None:
            found = self._kinds[values] = fingerprint(sorted(settings.items()))
        return found

    def _settings(self, exchange) -> dict:
        """What every rank's step must share beyond the layout."""
        sharded = self.sharded or (exchange is not None and not isinstance(exchange, Exchange))
        return {
            "shard_optimizer": sharded,
            "average": self.average,
            "accumulate": self.accumulate,
            "reduction": self._reduction,
        }

    def reduction(self, world: World) -> str:
        """How this step sums unsharded buckets: "shared" (shared_exchange.py: ranks on one
        node) or "mpi" (MPI's allreduce, from inside the compiled driver where it can)."""
        if self._reduction is None:
            if world.size == 1:
                self._reduction = "mpi"
            else:
                self._reduction = reduction(world.comm, self.timeout, _name(self.fn))
        return self._reduction


def _hookable(compiled) -> bool:
    """Whether the step may run this plan with the exchange inside its driver: the kernels are
    built, and the plan's driver is compiled, or runs as Python under BACKPLAN_DRIVER=background
    (the hooked driver is then built in a background process, see InPlanExchange.ready).
    BACKPLAN_DRIVER=python keeps every driver Python: the buckets start after the call."""
    if compiled is None or compiled.driver_tier == "reference":
        return False
    return compiled.driver_tier == "compiled" or driver_tier.driver_mode() == "background"


def _name(value_and_grad_fn) -> str:
    return f"{_bare_name(value_and_grad_fn)}()"


def _bare_name(value_and_grad_fn) -> str:
    return getattr(value_and_grad_fn.fn, "__name__", "the loss")


def data_parallel(
    value_and_grad_fn,
    average: bool = True,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    check_replicas: bool = False,
    split_plan: bool = False,
    comm=None,
    timeout: float | None = None,
    accumulate: int = 1,
    optimizer=None,
    shard_optimizer: bool = False,
    overlap: bool = True,
):
    """A training step that runs value_and_grad_fn on this rank's shard and returns the loss
    and gradients averaged over all ranks (summed with average=False), for any pytree of
    parameters. aux outputs (has_aux=True) stay this rank's own. Ranks may hold different
    numbers of rows (bpd.shard splits 10 rows on 3 ranks as 4, 3, 3): each rank's mean is then
    weighted by its rows, so the result is the mean over the global batch (the rows are the
    first axis of the arguments not differentiated, those whose lengths differ between ranks).

    Gradients travel in buckets of up to bucket_bytes, filled in the order the joint plan
    writes them; each bucket's non-blocking allreduce starts in that order as soon as the
    compiled call returns, so the plan decides the order but nothing overlaps compute. With
    split_plan=True the joint plan runs as segments cut after each bucket's last write, and
    each bucket's allreduce starts between segments, while the rest of the backward runs
    (each segment compiles on its own; fusion across a cut is lost). `step.explain(*args)`
    shows the buckets and when each starts. check_replicas=True hashes the differentiated
    arguments on every call and raises ReplicaMismatchError when any rank's differ (a debug
    mode: it costs a hash of every parameter per step). With one rank (and no accumulate or
    optimizer) the step is value_and_grad_fn itself: no MPI call at all.

    timeout (seconds, default None: wait forever, as MPI does): each call first checks that
    every rank reached it (one byte to and from each other rank), waiting by testing with short
    sleeps instead of spinning; a rank not heard from within timeout is named in a
    RankTimeoutError on the ranks waiting for it, which, uncaught, ends every rank (the hung
    one too) through MPI_Abort. The exchange's waits get the same deadline.

    accumulate=k: the first k - 1 calls of each round only add this rank's loss and gradients
    up (returning its own loss and None for the gradients); the k-th exchanges their mean once
    and returns what one call on all k micro-batches would (micro-batches of equal rows).

    optimizer=opt applies the update too: `state = step.init(params)`, then
    `params, state, loss = step(params, state, *batch)`. shard_optimizer=True (ZeRO-1) keeps on
    each rank the optimizer state of its 1/N of every parameter: each bucket is reduce-scattered,
    each rank updates its share, and the updated parameters are all-gathered; the parameters are
    the same as unsharded (for sgd, adam and adamw, whose updates are elementwise).

    >>> import backplan as bp, backplan.distributed as bpd  # doctest: +SKIP
    >>> step = bpd.data_parallel(bp.value_and_grad(loss_fn))  # doctest: +SKIP
    >>> loss, grads = step(params, bpd.shard(x, rank, size), y_shard)  # doctest: +SKIP
    """
    step = DataParallelStep(
        value_and_grad_fn,
        average=average,
        bucket_bytes=bucket_bytes,
        check_replicas=check_replicas,
        split_plan=split_plan,
        comm=comm,
        timeout=timeout,
        accumulate=accumulate,
        overlap=overlap,
    )
    if optimizer is None:
        if shard_optimizer:
            raise ValueError("shard_optimizer=True shards an optimizer's state: pass optimizer=")
        return step
    return DataParallelTraining(step, optimizer, shard_optimizer)


def preview_size(size, world) -> tuple[int, str | None]:
    """(ranks to preview, what the report says about a size it chose)."""
    if size is not None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"explain(size=...) is the number of ranks to preview, got {size!r}")
        return size, None
    if world is not None and world.size > 1:
        return world.size, None
    why = (
        "this process is the only rank (run without mpiexec)"
        if world is not None
        else "bpd.init() has not run here"
    )
    return 2, f"Previewed for 2 ranks: {why}; pass size=N to preview N ranks."
