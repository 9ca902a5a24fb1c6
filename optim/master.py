"""Master weights for 16-bit parameters, as mixed-precision optimizers keep them: the state holds
the parameters in float32 (`master`) and the wrapped optimizer's state of those (`inner`); an
update casts the gradients up, steps the master weights, and returns them rounded to each
parameter's dtype. Small steps then accumulate in float32 instead of vanishing when a bfloat16
parameter (8 significant bits) rounds them away. A parameter already in float32 is its own
master weight (None in `master`): no second copy of it is kept or returned.

    opt = bp.optim.adam(1e-3, master_dtype=bp.float32)
    state = opt.init(params)                          # {"master": ..., "inner": ...}
    params, state = opt.update(grads, state, params)  # params keep their bf16 dtype
"""

from __future__ import annotations

import warnings

from backplan.ir.types import dtype_name, is_float, is_half
from backplan.tracer import ops
from backplan.tracer.pytree import flatten, unflatten

from .tree import tree_map_n


class PrecisionWarning(UserWarning):
    """An optimizer steps 16-bit parameters in their own dtype (no master_dtype)."""


def warn_without_master(optimizer: str, params) -> None:
    """16-bit float parameters stepped as they are lose every update smaller than half their
    last bit (a relative 2**-9 in bfloat16, 2**-12 in float16): say so once, at init, as
    PyTorch's AMP guide and optax's mixed-precision recipes keep float32 master weights."""
    leaves, _, paths = flatten(params, paths=True)
    half = [
        f"{path} ({leaf.dtype})"
        for leaf, path in zip(leaves, paths, strict=True)
        if is_half(dtype_name(leaf.dtype))
    ]
    if half:
        warnings.warn(
            f"bp.optim.{optimizer}.init: {len(half)} parameter(s) in 16 bits without "
            f"master_dtype ({', '.join(half[:4])}{' ...' if len(half) > 4 else ''}): each step "
            "is added in that dtype, so updates smaller than half the weight's last bit are "
            "lost (lr 1e-3 steps vanish on weights of 1 in bfloat16). Pass "
            "master_dtype=bp.float32 to keep float32 master weights; silence this warning "
            "(bp.optim.PrecisionWarning) to step them as they are",
            PrecisionWarning,
            stacklevel=3,
        )


def master_name(optimizer: str, master_dtype) -> str:
    """The IR name of a master dtype: float32 or float64 (checked, naming the optimizer)."""
    name = dtype_name(master_dtype)
    if name not in ("f32", "f64"):
        raise ValueError(
            f"bp.optim.{optimizer}: master_dtype={master_dtype!r}; master weights are kept in "
            "bp.float32 (or bp.float64)"
        )
    return name


def master_init(optimizer, params) -> dict:
    """A parameter already in the master dtype is its own master weight: its slot in `master`
    is None. A copy there would be the same value as the parameter, and the step would return
    one buffer as both (a float32 model trained with master_dtype=bp.float32): passed back
    donated, neither could be written in place, so each step allocated the parameters anew,
    beside the peak explain printed."""
    leaves, treedef = flatten(params)
    dtype = optimizer.master_dtype
    master = [None if _own_master(p, dtype) else ops.astype(p, dtype) for p in leaves]
    full = [p if m is None else m for p, m in zip(leaves, master, strict=True)]
    return {
        "master": unflatten(treedef, master),
        "inner": optimizer.init_fn(unflatten(treedef, full)),
    }


def master_update(optimizer, grads, state, params):
    if not isinstance(state, dict) or set(state) != {"master", "inner"}:
        raise TypeError(
            f"bp.optim.{optimizer.name} keeps master weights (master_dtype): pass the state its "
            "own init(params) built ({'master': ..., 'inner': ...})"
        )
    leaves, treedef, paths = flatten(params, paths=True)
    kept, _, kept_paths = flatten(state["master"], paths=True)
    by_path = dict(zip(kept_paths, kept, strict=True))
    for p, q in zip(leaves, paths, strict=True):
        if q not in by_path and not _own_master(p, optimizer.master_dtype):
            raise TypeError(
                f"bp.optim.{optimizer.name}: parameter {q} ({p.dtype}) has no master weight in "
                "the state; pass the state init(params) built for these parameters"
            )
    master = unflatten(treedef, [by_path.get(q, p) for p, q in zip(leaves, paths, strict=True)])
    grads = _cast(grads, optimizer.master_dtype)
    updates, inner = optimizer.transform(grads, state["inner"], master)
    master = tree_map_n(lambda m, u: m + u, master, updates)
    new = flatten(master)[0]
    kept = unflatten(
        treedef, [m if q in by_path else None for m, q in zip(new, paths, strict=True)]
    )
    return _like(master, params), {"master": kept, "inner": inner}


def _own_master(param, dtype: str) -> bool:
    return param._ir_dtype == dtype


def _cast(tree, dtype: str):
    leaves, treedef = flatten(tree)
    return unflatten(treedef, [ops.astype(leaf, dtype) for leaf in leaves])


def _like(master, params):
    """The master weights rounded to each parameter's dtype, keeping requires_grad flags."""
    leaves, treedef = flatten(master)
    new = []
    for m, p in zip(leaves, flatten(params)[0], strict=True):
        value = ops.astype(m, p._ir_dtype) if is_float(p._ir_dtype) else m
        if p._data is not None and p.requires_grad:
            value.requires_grad = True
        new.append(value)
    return unflatten(treedef, new)
