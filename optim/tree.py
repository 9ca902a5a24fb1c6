"""Leaf-by-leaf helpers over parameter pytrees, with the checks that make mistakes loud."""

from __future__ import annotations

import functools
import math

import numpy as np

from backplan.ir.types import is_float
from backplan.tracer.float_checks import check_float_when_called
from backplan.tracer.pytree import difference, flatten, unflatten
from backplan.tracer.tensor import Tensor


def float_leaves(tree, where: str) -> list[Tensor]:
    """The leaves of a parameter tree, each a float tensor."""
    leaves, _, paths = flatten(tree, paths=True)
    for leaf, path in zip(leaves, paths, strict=True):
        if not isinstance(leaf, Tensor):
            raise TypeError(
                f"{where}: leaf {path} is a {type(leaf).__name__}; parameters and gradients "
                "must be pytrees (dicts, lists, tuples, dataclasses) of tensors (wrap arrays in "
                "bp.tensor; mark a dataclass field that is not a tensor with "
                "bp.tree.static_field())"
            )
        if not is_float(leaf._ir_dtype):
            raise TypeError(
                f"{where}: leaf {path} is a {leaf.dtype} tensor; optimizers update float "
                "tensors only (keep integer buffers out of the parameter tree)"
            )
    return leaves


def check_same_structure(grads, params, where: str) -> None:
    g_leaves, g_def = flatten(grads)
    p_leaves, p_def = flatten(params)
    if g_def != p_def:
        raise TypeError(
            f"{where}: grads and params have different structures, at "
            f"{difference(g_def, p_def)} (grads first; {len(g_leaves)} vs {len(p_leaves)} "
            "leaves); pass the gradients bp.value_and_grad returned for exactly these params"
        )
    float_leaves(grads, where)
    for g, p, path in zip(g_leaves, p_leaves, flatten(params, paths=True)[2], strict=True):
        if g.shape != p.shape:
            raise TypeError(f"{where}: grad {path} has shape {g.shape}, param has {p.shape}")
        if g._ir_dtype != p._ir_dtype:
            # torch refuses a .grad of another dtype; adding it would widen the parameter
            # (and retrace a compiled step with the new dtype)
            raise TypeError(
                f"{where}: grad {path} is {g.dtype}, param is {p.dtype}; an update keeps each "
                f"parameter's dtype: cast the gradient (g.astype(bp.{p.dtype}))"
            )


def check_updates(updates, params, where: str) -> None:
    """updates have params' structure, and each leaf is a tensor (or NumPy array) of its
    parameter's shape and dtype (an update is added to its parameter as it is)."""
    pairs = _paired_with_params(
        updates,
        params,
        lambda at, n, n_params: (
            f"{where}: updates and params have different structures, at {at} (updates first; "
            f"{n} vs {n_params} leaves); pass the updates an optimizer's transform made for "
            "these params"
        ),
    )
    for u, p, path in pairs:
        if not isinstance(u, Tensor | np.ndarray) or (u.shape, str(u.dtype)) != (
            p.shape,
            str(p.dtype),
        ):
            raise TypeError(
                f"{where}: update {path} is {_held(u)}, param {path} is {p.dtype} {p.shape}; "
                "an update keeps its parameter's shape and dtype"
            )


def check_state(optimizer: str, state, params, moments: tuple[str, ...]) -> None:
    """The state an update reads is the one this optimizer's init(params) built: a dict of a
    step count and one tree per moment, each leaf of its parameter's shape and dtype. A moment
    of another shape would broadcast and silently change the parameter's shape."""
    where = f"bp.optim.{optimizer}.update(grads, state, params)"
    wanted = ["count", *moments]
    if not isinstance(state, dict) or sorted(state) != sorted(wanted):
        held = f"keys {sorted(state)}" if isinstance(state, dict) else f"a {type(state).__name__}"
        raise TypeError(
            f"{where}: the state holds {held}, but this optimizer's state holds keys "
            f"{sorted(wanted)}; pass the state its own init(params) returned (another "
            "optimizer's state, or one built with other options, does not fit)"
        )
    count = state["count"]
    if not isinstance(count, Tensor) or count.shape != () or count._ir_dtype != "i64":
        raise TypeError(f"{where}: state['count'] must be the 0-d int64 tensor init(params) made")
    for key in moments:
        check_leaves_like(state[key], params, f"{where}: state['{key}']")


def check_wrapper_state(name: str, state, keys: tuple[str, ...], grads, params) -> None:
    """The state of a wrapping optimizer (loss_scale, accumulate) is the dict of keys its own
    init(params) made, and grads fit params."""
    if not isinstance(state, dict) or tuple(state) != keys:
        raise TypeError(
            f"bp.optim.{name}.update needs the state of its own init(params) "
            f"(a dict of {', '.join(keys)})"
        )
    check_same_structure(grads, params, f"{name}.update(grads, state, params)")


def check_leaves_like(tree, params, what: str) -> None:
    """tree has params' structure, and each leaf its parameter's shape and dtype."""
    pairs = _paired_with_params(
        tree,
        params,
        lambda at, n, n_params: (
            f"{what} does not match the parameters: they differ at {at} (the state first); "
            "pass the state that init(params) returned for params of this structure, with dict "
            "keys in the same order"
        ),
    )
    for leaf, p, path in pairs:
        if not isinstance(leaf, Tensor) or leaf.shape != p.shape or leaf._ir_dtype != p._ir_dtype:
            raise TypeError(
                f"{what}{path} is {_held(leaf)}, but param {path} is {p.dtype} {p.shape}; the "
                "state was built for other parameters: build it with init(params) for these"
            )


def _paired_with_params(tree, params, differ):
    """(leaf, param, path) for each parameter, once tree has params' structure; differ(at,
    leaves, param leaves) says where it does not."""
    leaves, treedef = flatten(tree)
    p_leaves, p_def, paths = flatten(params, paths=True)
    if treedef != p_def:
        raise TypeError(differ(difference(treedef, p_def), len(leaves), len(p_leaves)))
    return zip(leaves, p_leaves, paths, strict=True)


def _held(leaf) -> str:
    return f"{leaf.dtype} {leaf.shape}" if hasattr(leaf, "shape") else type(leaf).__name__


def tree_map_n(fn, *trees):
    """fn applied leaf by leaf across trees of the same structure (the first one's)."""
    first, treedef, rest = _same_structure(trees)
    return unflatten(treedef, [fn(*leaves) for leaves in zip(first, *rest, strict=True)])


def tree_map_tuple(fn, *trees, n: int):
    """Like tree_map_n for an fn returning n values: n trees."""
    first, treedef, rest = _same_structure(trees)
    results = [fn(*leaves) for leaves in zip(first, *rest, strict=True)]
    return tuple(unflatten(treedef, [r[k] for r in results]) for k in range(n))


def _same_structure(trees) -> tuple[list, object, list[list]]:
    """The first tree's leaves and structure, and the others' leaves, all of one structure:
    optimizer state zipped with gradients by position would pair a moment with the wrong
    parameter when a dict lists its keys in another order."""
    first, treedef = flatten(trees[0])
    rest = []
    for tree in trees[1:]:
        leaves_, other = flatten(tree)
        if other != treedef:
            raise TypeError(
                "optimizer state does not match the parameters and gradients: they differ at "
                f"{difference(treedef, other)} (the state first); pass the state that "
                "init(params) returned for params of this structure, with dict keys in the same "
                "order"
            )
        rest.append(leaves_)
    return first, treedef, rest


def check_hyper(optimizer: str, name: str, value, positive: bool = False, below_one=False):
    """Check a hyperparameter given as a Python or NumPy number, or as a compiled function's
    traced float argument (checked on every call with its value: tracer/float_checks.py).
    NaN and infinity are refused too: torch.optim.Adam refuses a NaN rate, and neither makes
    a usable step. Other tensors (a schedule's value) are computed in the step, unchecked."""
    if isinstance(value, Tensor):
        if value._data is not None and value._data.size == 1:  # a concrete scalar: its value
            value = value._data.item()
        else:
            check = functools.partial(check_hyper, optimizer, name, positive=positive)
            check_float_when_called(value, functools.partial(check, below_one=below_one))
            return
    if isinstance(value, bool | np.ndarray) or callable(value):  # a schedule: computed in the step
        return
    if not isinstance(value, int | float | np.integer | np.floating):
        # a string or None failed later inside the update, naming `mul`, not this argument
        raise TypeError(
            f"bp.optim.{optimizer}: {name} must be a number, a tensor or a schedule (a function "
            f"of the step count), got {type(value).__name__} {value!r}"
        )
    if not math.isfinite(value):
        raise ValueError(f"bp.optim.{optimizer}: {name} must be a finite number, got {value!r}")
    if value < 0 or (positive and value == 0) or (below_one and value >= 1):
        wanted = "positive" if positive else "at least 0"
        wanted += " and below 1" if below_one else ""
        raise ValueError(f"bp.optim.{optimizer}: {name} must be {wanted}, got {value!r}")
