"""The optimizer contract, optax-style because tensors are immutable: a transformation turns
gradients into updates with some state; an Optimizer applies the updates to the parameters.

    opt = bp.optim.adam(1e-3)
    state = opt.init(params)                          # a pytree of tensors
    params, state = opt.update(grads, state, params)  # new tensors, nothing changes in place

The same calls run eagerly and inside @bp.compile, so one compiled step can do the forward, the
backward and the update (pass params and state with donate_argnums to update in place).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from backplan.runtime import no_grad
from backplan.tracer.pytree import flatten, unflatten

from .master import master_init, master_name, master_update, warn_without_master
from .tree import check_same_structure, check_updates, float_leaves


@dataclass(frozen=True)
class Optimizer:
    """A gradient transformation: `init(params) -> state` and
    `transform(updates, state, params) -> (updates, state)`. `update` applies the result:
    new params are params + updates. Build them with sgd, adam, adamw, clip_by_global_norm
    and chain."""

    name: str
    init_fn: Callable
    transform: Callable
    master_dtype: str | None = None  # float32 master weights for 16-bit parameters
    # each element's update reads only that element of the gradients, parameters and state
    # (and the step count): updating any slice of a flattened parameter gives the same bytes
    # there as updating the whole, so a sharded optimizer (ZeRO-1) may split the parameters
    elementwise: bool = False

    def init(self, params):
        """The optimizer state for these parameters: tensors (step count, moments); with
        master_dtype, {"master": the parameters in that dtype, "inner": the state of those}.
        16-bit parameters without master_dtype get a bp.optim.PrecisionWarning."""
        float_leaves(params, f"{self.name}.init(params)")
        with no_grad():
            if self.master_dtype is not None:
                return master_init(self, params)
            state = self.init_fn(params)  # first: a refusal (adam's float16 eps) says it all
            warn_without_master(self.name, params)
            return state

    def update(self, grads, state, params):
        """(new params, new state). Eagerly, new parameters keep the old requires_grad flags,
        so `loss.backward()` works on them at the next step."""
        where = f"{self.name}.update(grads, state, params)"
        check_same_structure(grads, params, where)
        with no_grad():
            return self.step(grads, state, params)

    def step(self, grads, state, params):
        """update without its checks, under no_grad (for wrappers: optim/loss_scale.py);
        with master weights, grads may be float32 for 16-bit params."""
        if self.master_dtype is not None:
            return master_update(self, grads, state, params)
        updates, state = self.transform(grads, state, params)
        return _add(params, updates), state

    def __repr__(self) -> str:
        return f"bp.optim.{self.name}"


def apply_updates(params, updates):
    """params + updates, leaf by leaf; concrete leaves keep their requires_grad flag. The
    updates must be params' structure, shapes and dtypes: leaves paired by position would add
    an update to another parameter where dict keys differ, and one that broadcasts or has
    another dtype would change the parameter's shape or widen it."""
    check_updates(updates, params, "bp.optim.apply_updates(params, updates)")
    return _add(params, updates)


def _add(params, updates):
    """apply_updates without its checks: an optimizer's own updates fit its parameters."""
    leaves, treedef = flatten(params)
    deltas, _ = flatten(updates)
    new = []
    for p, u in zip(leaves, deltas, strict=True):
        value = p + u
        if p._data is not None and p.requires_grad:
            value.requires_grad = True  # made under no_grad: a new leaf
        new.append(value)
    return unflatten(treedef, new)


def chain(*transforms: Optimizer, master_dtype=None) -> Optimizer:
    """Apply transformations in order, each to the updates of the one before (optax.chain):
    `bp.optim.chain(bp.optim.clip_by_global_norm(1.0), bp.optim.adam(1e-3))`.
    The state is a tuple with one entry per transformation."""
    for t in transforms:
        if not isinstance(t, Optimizer):
            raise TypeError(
                f"bp.optim.chain takes optimizers and transformations (bp.optim.sgd(...), "
                f"bp.optim.clip_by_global_norm(...)), got {type(t).__name__}"
            )
        if t.transform is None:
            raise ValueError(
                f"bp.optim.chain: {t.name} wraps a whole optimizer; wrap the chain instead "
                "(bp.optim.loss_scale(bp.optim.chain(...)))"
            )
        if t.master_dtype is not None:
            raise ValueError(
                f"bp.optim.chain: {t.name} has master_dtype; inside a chain it would not apply "
                "(a chain runs its transformations on one set of weights): pass master_dtype "
                "to bp.optim.chain(..., master_dtype=bp.float32) instead"
            )

    def init_fn(params):
        return tuple(t.init_fn(params) for t in transforms)

    def transform(updates, state, params):
        if not isinstance(state, tuple) or len(state) != len(transforms):
            raise TypeError(
                f"chain of {len(transforms)} transformations needs the state from its own "
                "init(params) (a tuple with one entry per transformation)"
            )
        new_states = []
        for t, s in zip(transforms, state, strict=True):
            updates, s = t.transform(updates, s, params)
            new_states.append(s)
        return updates, tuple(new_states)

    names = ", ".join(t.name for t in transforms)
    elementwise = all(t.elementwise for t in transforms)
    return with_master(
        Optimizer(f"chain({names})", init_fn, transform, elementwise=elementwise), master_dtype
    )


def with_master(optimizer: Optimizer, master_dtype) -> Optimizer:
    """The optimizer keeping master weights in master_dtype (None: as it is)."""
    if master_dtype is None:
        return optimizer
    return replace(optimizer, master_dtype=master_name(optimizer.name, master_dtype))
