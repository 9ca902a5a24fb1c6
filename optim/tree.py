"""Leaf-by-leaf helpers over parameter pytrees, with the checks that make mistakes loud."""

from __future__ import annotations

from backplan.ir.types import is_float
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
    """Check a hyperparameter given as a Python number (traced floats are checked by the
    caller's arithmetic only: their value is unknown while tracing)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return
    if value < 0 or (positive and value == 0) or (below_one and value >= 1):
        wanted = "positive" if positive else "at least 0"
        wanted += " and below 1" if below_one else ""
        raise ValueError(f"bp.optim.{optimizer}: {name} must be {wanted}, got {value!r}")
