"""clip_by_global_norm: scale all gradients together so their joint L2 norm is at most
max_norm, as torch.nn.utils.clip_grad_norm_ (coefficient max_norm / (norm + 1e-6), at most 1)."""

from __future__ import annotations

from backplan.tracer import ops
from backplan.tracer.pytree import flatten

from .base import Optimizer
from .tree import check_hyper, tree_map_n


def global_norm(tree):
    """sqrt of the sum of squares of every leaf (a 0-d tensor)."""
    leaves, _ = flatten(tree)
    if not leaves:
        raise ValueError(
            "bp.optim.global_norm: the tree holds no tensors, so it has no norm (pass the "
            "gradients or parameters themselves)"
        )
    total = None
    for leaf in leaves:
        squares = ops.sum(leaf * leaf)
        total = squares if total is None else total + squares
    return ops.sqrt(total)


def clip_by_global_norm(max_norm: float) -> Optimizer:
    """Compose it before an optimizer: `bp.optim.chain(bp.optim.clip_by_global_norm(1.0),
    bp.optim.adam(1e-3))`. Its state is empty."""
    check_hyper("clip_by_global_norm", "max_norm", max_norm, positive=True)

    def init_fn(params):
        return ()

    def transform(updates, state, params):
        coefficient = ops.minimum(max_norm / (global_norm(updates) + 1e-6), 1.0)
        return tree_map_n(lambda g: g * ops.astype(coefficient, g.dtype), updates), state

    return Optimizer(f"clip_by_global_norm({max_norm})", init_fn, transform)
