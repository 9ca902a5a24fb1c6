"""data_parallel(..., optimizer=opt): the step that also applies the update, so that the optimizer
state can be sharded (ZeRO-1, shard_optimizer=True): each rank keeps the state of its 1/N of
every bucket and updates those parameters only (sharding.py). Unsharded, every rank applies the
whole update to the averaged gradients. Both give the same parameters: the optimizers that may
be sharded update each element from that element alone (Optimizer.elementwise)."""

from __future__ import annotations

import threading
from functools import partial

import numpy as np

from backplan.ir.types import np_dtype
from backplan.runtime import no_grad
from backplan.tracer import compile
from backplan.tracer.pytree import flatten, unflatten
from backplan.tracer.tensor import Tensor

from .agreement import leaf_array
from .exchange import Exchange
from .failure import describe_error, out_of_step_text
from .rank_peak import PlanFacts, allreduce_peak, sharded_peak
from .sharding import ShardedExchange, bytes_sent, flat_shares, groups_of
from .shared_exchange import window_bytes
from .shared_sharding import sharded_window_bytes
from .world import init, sums_by_recursive_doubling


class DataParallelTraining:
    """`state = step.init(params)`, then `params, state, loss = step(params, state, *batch)`
    (loss is (loss, aux) with has_aux); see data_parallel."""

    def __init__(self, step, optimizer, shard_optimizer: bool):
        if not all(callable(getattr(optimizer, name, None)) for name in ("init", "update")):
            raise TypeError(
                "data_parallel(optimizer=...) takes a bp.optim optimizer (bp.optim.adam(1e-3)), "
                f"got {type(optimizer).__name__}"
            )
        if step.fn.argnums != 0:
            raise ValueError(
                f"data_parallel(optimizer=...) updates the first argument, but the step "
                f"differentiates argnums={step.fn.argnums!r}; use bp.value_and_grad(loss_fn) "
                "with the parameters first"
            )
        if shard_optimizer and not getattr(optimizer, "elementwise", False):
            name = getattr(optimizer, "name", optimizer)
            raise ValueError(
                f"shard_optimizer=True needs an optimizer that updates each element from that "
                f"element alone (sgd, adam, adamw, chains and accumulate of them); {name} "
                "reads all the gradients at once (a global norm or a finiteness check), which "
                "no rank holds: use shard_optimizer=False"
            )
        if shard_optimizer and step.split_plan:
            raise ValueError("shard_optimizer=True runs the plan as one call; drop split_plan")
        self.step = step
        step.sharded = shard_optimizer
        self.optimizer = optimizer
        self.shard_optimizer = shard_optimizer
        # one compiled update (fused loops instead of ~10 eager ops per parameter); the same
        # function updates whole parameters and 1-D shares, element by element alike
        self._buffers: dict = {}  # the sharded exchange's receive buffers, reused per call
        self._lock = threading.Lock()  # calls from two threads take turns: they share buffers
        self._update = compile(lambda grads, state, params: optimizer.update(grads, state, params))

    def init(self, params):
        """The optimizer state this rank keeps: the whole optimizer's init(params), or with
        shard_optimizer=True the state of a tuple with this rank's 1-D range of each dtype's
        parameters, flattened end to end (about 1/N of them; sharding.py)."""
        if not self.shard_optimizer:
            return self.optimizer.init(params)
        world = init(self.step._comm)
        return self.optimizer.init(flat_shares(params, world.rank, world.size))

    def __call__(self, params, state, *batch, **kwargs):
        if self.shard_optimizer:
            return self._sharded(params, state, batch, kwargs)
        world = init(self.step._comm)
        args = (params, *batch)
        if world.size == 1 and self.step.accumulate == 1:
            result = self.step.fn(*args, **kwargs)
            return self._unsharded_update(params, state, result)
        exchange, loss, aux = self.step.started(args, kwargs, Exchange)
        if exchange is None:
            return params, state, self._loss(loss, aux)
        summed = exchange.finish()
        grads = unflatten(exchange.layout.grad_treedef, summed[1:])
        result = ((summed[0], aux), grads) if self.step.fn.has_aux else (summed[0], grads)
        return self._unsharded_update(params, state, result)

    def _unsharded_update(self, params, state, result):
        (loss, aux), grads = result if self.step.fn.has_aux else ((result[0], None), result[1])
        try:
            new, state = self._update(grads, state, params)
        except BaseException as error:
            if init(self.step._comm).size > 1:
                self.step._diverged = describe_error(error)
                error.add_note(
                    "backplan.distributed: the other ranks applied this call's update, so this "
                    "rank's parameters no longer match theirs: its next call tells them (they "
                    "raise RankFailedError) and raises RankOutOfStepError; restart from the "
                    "last checkpoint"
                )
            raise
        leaves, treedef = flatten(params)
        return unflatten(treedef, _like(flatten(new)[0], leaves)), state, self._loss(loss, aux)

    def _loss(self, loss, aux):
        return (loss, aux) if self.step.fn.has_aux else loss

    def _sharded(self, params, state, batch, kwargs):
        with self._lock:
            return self._sharded_step(params, state, batch, kwargs)

    def _sharded_step(self, params, state, batch, kwargs):
        exchange_type = partial(ShardedExchange, pool=self._buffers)
        exchange, loss, aux = self.step.started((params, *batch), kwargs, exchange_type)
        if exchange is None:
            return params, state, self._loss(loss, aux)
        loss, grad_ranges = exchange.finish()
        leaves, treedef = flatten(params)
        arrays = [leaf_array(leaf) for leaf in leaves]
        if not exchange.same_groups(arrays):
            groups = groups_of(params, exchange.world.size)[0]
            raise ValueError(_dtype_mismatch(groups, exchange.groups))
        ranges = tuple(
            Tensor._fresh(exchange.owned_range(k, arrays)) for k in range(len(exchange.groups))
        )
        # views of the exchange's pooled receive buffer, read by the update and never returned:
        # wrapped without the copy _from_array makes of a writeable buffer's view (1.3 MB a
        # step on the bench mlp's 2 ranks)
        grads = tuple(Tensor._fresh(g) for g in grad_ranges)
        try:
            new_ranges, state = self._update(grads, state, ranges)
        except BaseException as error:
            self._update_failed(exchange, ranges, error)
            if isinstance(error, TypeError):
                raise TypeError(
                    f"{error}\n(with shard_optimizer=True the state is this rank's share: pass "
                    "the state step.init(params) returned, not optimizer.init(params))"
                ) from error
            raise
        gathered = exchange.gather([leaf_array(t) for t in new_ranges])
        new = _like([Tensor._fresh(a) for a in gathered], leaves)
        return unflatten(treedef, new), state, self._loss(Tensor._fresh(loss), aux)

    def _update_failed(self, exchange, ranges, error) -> None:
        """This rank's update raised: join the all-gather anyway, with NaN (sharding.gather), so
        the other ranks raise RankFailedError instead of waiting there (or returning it);
        where that fails (the others gone, or the deadline passed), the step is out of step."""
        try:
            exchange.gather([leaf_array(t) for t in ranges], failure=describe_error(error))
        except BaseException as telling:
            name = f"{exchange.layout.name}()"
            self.step._out_of_step = out_of_step_text(exchange.world, error, name, telling)
            error.add_note(f"backplan.distributed: {self.step._out_of_step}")
            return
        error.add_note(
            f"backplan.distributed: rank {exchange.world.rank} joined this call's all-gather "
            "saying its update failed, so the other ranks raised RankFailedError and no rank "
            "returned this call's parameters or state: the step may be called again"
        )

    def explain(self, params, state, *batch, size: int | None = None, **kwargs):
        """The step's report (DataParallelStep.explain) with the optimizer state each rank
        keeps; pass the arguments of a call (params, state, *batch)."""
        report = self.step.explain(params, *batch, size=size, **kwargs)
        name = getattr(self.optimizer, "name", type(self.optimizer).__name__)
        report.add_optimizer(name, *self.state_bytes(params, report.size))
        if self.shard_optimizer:
            groups = groups_of(params, report.size)[0]
            loss_dtype = np_dtype(report.layout.loss_dtype)
            report.add_sharding(bytes_sent(groups, report.size, loss_dtype))
        if self.step.counts_rank_peak():
            report.rank_peak = self._rank_peak(report, params, state, batch, kwargs)
        return report

    def _rank_peak(self, report, params, state, batch, kwargs):
        """What one rank holds in the loop `params, state, loss = step(params, state, *batch)`
        (rank_peak.py); the update's figures from its own compiled plan for these shapes."""
        plan = self.step.plan_facts((params, *batch), kwargs)
        mine = self.step.param_bytes((params, *batch))
        held = _nbytes(state)
        if not self.shard_optimizer:
            grads = _zeros_like(params)
            update = _update_facts(self._update, grads, state, params)
            doubling = not report.shared and sums_by_recursive_doubling(report.size)
            window = window_bytes(report.layout, report.size) if report.shared else 0
            return allreduce_peak(
                report.layout,
                report.in_plan,
                plan,
                mine,
                update,
                held,
                doubling,
                report.size,
                window,
                into_window=(
                    self.step.window_leaves((params, *batch), kwargs, report.layout, report.size)
                    if window
                    else ()
                ),
            )
        world = init(self.step._comm)
        rank = world.rank if world.size == report.size else 0
        shares = flat_shares(params, rank, report.size)
        update = _update_facts(self._update, _zeros_like(shares), state, shares)
        groups = groups_of(params, report.size)[0]
        loss_dtype = np_dtype(report.layout.loss_dtype)
        ranges = [leaf_array(x).nbytes for x in shares]
        window = sharded_window_bytes(groups, loss_dtype) if report.shared else 0
        written = ()
        if window:
            written = self.step.window_leaves((params, *batch), kwargs, report.layout, report.size)
        return sharded_peak(
            groups, rank, loss_dtype, plan, update, held, ranges, window, into_window=written
        )

    def state_bytes(self, params, size: int) -> tuple[int, int]:
        """(the bytes of optimizer state rank 0, which holds the largest shares, keeps; the
        bytes of the whole state, which every rank keeps without sharding)."""
        whole = _nbytes(self.optimizer.init(params))
        if not self.shard_optimizer:
            return whole, whole
        return _nbytes(self.optimizer.init(flat_shares(params, 0, size))), whole


def _zeros_like(tree):
    leaves, treedef = flatten(tree)
    return unflatten(treedef, [Tensor._fresh(np.zeros_like(leaf_array(x))) for x in leaves])


def _update_facts(update, grads, state, params) -> PlanFacts:
    """The compiled update's call at its peak: run without recording a backward, as the
    step runs it (it returns new arrays nobody differentiates)."""
    with no_grad():
        return PlanFacts.of(update.explain(grads, state, params).call_peak)


def _like(tensors: list, params: list) -> list:
    """tensors (new, held by nobody else) with each parameter's requires_grad flag."""
    for tensor, p in zip(tensors, params, strict=True):
        tensor.requires_grad = p.requires_grad
    return tensors


def _dtype_mismatch(params, grads) -> str:
    def text(groups):
        return ", ".join(f"{g.total:,} {g.dtype} elements" for g in groups)

    return (
        f"shard_optimizer=True: the parameters hold {text(params)} but their gradients "
        f"{text(grads)}; a sharded update needs each gradient in its parameter's dtype"
    )


def _nbytes(tree) -> int:
    return sum(leaf_array(leaf).nbytes for leaf in flatten(tree)[0])
