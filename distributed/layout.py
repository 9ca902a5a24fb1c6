"""The exchange layout of one signature of a data-parallel step: which arrays every rank adds up
(the loss and each gradient), the joint-plan step that writes each, and the buckets they travel
in. Read from the traced joint plan alone, so explain() needs neither MPI nor a run."""

from __future__ import annotations

import os
from dataclasses import dataclass

from backplan.ir.liveness import INPUT_STEP, Plan
from backplan.tracer.pytree import TreeDef, flatten

from .agreement import fingerprint
from .buckets import Bucket, ExchangedLeaf, plan_buckets
from .errors import DistributedError


@dataclass(frozen=True)
class Layout:
    """Everything the exchange of one signature needs, equal on every rank that agrees."""

    name: str
    buckets: tuple[Bucket, ...]
    n_leaves: int  # the loss and the gradients
    grad_treedef: TreeDef
    plan_steps: int  # steps of the joint plan; the call returns after the last one
    fingerprint: int
    output_positions: tuple[int, ...]  # leaf index -> position among the joint plan's outputs

    @property
    def loss_dtype(self) -> str:
        """The loss's IR dtype (leaf 0)."""
        return next(x.dtype for b in self.buckets for x in b.leaves if x.index == 0)

    def description(self) -> list[tuple[str, tuple, str]]:
        """(path, shape, dtype) of every gradient in the order of the arguments, then of the
        loss, for error messages (a wrong parameter is named before the loss it changes)."""
        leaves = sorted(
            (x for b in self.buckets for x in b.leaves), key=lambda x: (x.index == 0, x.index)
        )
        return [(x.path, x.shape, x.dtype) for x in leaves]


def build_layout(value_and_grad_fn, args, kwargs, bucket_bytes: int) -> Layout:
    """Trace (or find in its cache) the joint plan for these arguments and lay out its outputs."""
    entry = value_and_grad_fn.lookup(args, kwargs)[1]
    plan: Plan = entry.plan
    outputs = plan.graph.outputs
    values = [outputs[0], *outputs[1 + entry.n_aux :]]
    argnums = value_and_grad_fn.argnums
    if isinstance(argnums, int):
        _, treedef, paths = flatten(args[argnums], paths=True, prefix="grad")
    else:
        _, treedef, paths = flatten(tuple(args[i] for i in argnums), paths=True, prefix="grad")
    names = ["loss", *paths]
    if len(names) != len(values):
        raise DistributedError(
            f"the joint plan returns {len(values) - 1} gradients for {len(paths)} leaves of "
            "the differentiated arguments; data_parallel cannot pair them"
        )
    leaves = [
        ExchangedLeaf(i, name, v.shape, v.dtype, v.type.nbytes, *_ready(plan, v))
        for i, (name, v) in enumerate(zip(names, values, strict=True))
    ]
    buckets = tuple(plan_buckets(leaves, bucket_bytes))
    shape_of_exchange = [[(x.path, x.shape, x.dtype) for x in bucket.leaves] for bucket in buckets]
    return Layout(
        name=plan.graph.name,
        buckets=buckets,
        n_leaves=len(leaves),
        grad_treedef=treedef,
        plan_steps=plan.return_step,
        fingerprint=fingerprint(shape_of_exchange),
        output_positions=(0, *range(1 + entry.n_aux, len(outputs))),
    )


def _ready(plan: Plan, value) -> tuple[int, str]:
    step = plan.first_write.get(value, INPUT_STEP)
    if step == INPUT_STEP:
        return step, "on entry (an input)"
    where = f"{os.path.basename(value.loc[0])}:{value.loc[1]}" if value.loc else "<unknown>"
    return step, f"s{step} {value.op} at {where}"
