"""Adam and AdamW, as torch.optim.Adam / AdamW (amsgrad off), with t = count + 1:

    g = g + weight_decay * p                       (adam: L2 penalty in the gradient)
    p = p * (1 - lr * weight_decay)                (adamw: decoupled decay, before the step)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    p = p - lr / (1 - b1**t) * m / (sqrt(v) / sqrt(1 - b2**t) + eps)

Bias corrections are computed in float64 from the step count and cast to each parameter's
dtype, as torch computes them in Python floats.
"""

from __future__ import annotations

import numpy as np

from backplan.tracer import ops
from backplan.tracer.pytree import flatten

from .base import Optimizer, with_master
from .hyper import leaf_scalar, learning_rate, lr_text, new_count
from .tree import check_hyper, check_state, tree_map_n


def adam(
    lr, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, weight_decay=0.0, master_dtype=None
):
    """lr: a float or a schedule `lambda step: ...`; weight_decay adds weight_decay * p to the
    gradient (L2), as torch.optim.Adam; use adamw for decoupled decay. master_dtype=bp.float32
    keeps float32 master weights (and moments) of 16-bit parameters (optim/master.py).

    >>> import backplan as bp
    >>> params = {"w": bp.tensor([1.0, -1.0])}
    >>> opt = bp.optim.adam(0.1)
    >>> params, state = opt.update({"w": bp.tensor([3.0, -0.5])}, opt.init(params), params)
    >>> [round(x, 4) for x in params["w"].tolist()]
    [0.9, -0.9]
    """
    return with_master(_adam("adam", lr, b1, b2, eps, weight_decay, False), master_dtype)


def adamw(
    lr, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, weight_decay=0.01, master_dtype=None
):
    """Adam with decoupled weight decay (torch.optim.AdamW; default weight_decay 0.01):
    parameters shrink by lr * weight_decay * p before the Adam step."""
    return with_master(_adam("adamw", lr, b1, b2, eps, weight_decay, True), master_dtype)


def _adam(name, lr, b1, b2, eps, weight_decay, decoupled: bool) -> Optimizer:
    check_hyper(name, "lr", lr)
    check_hyper(name, "b1", b1, below_one=True)
    check_hyper(name, "b2", b2, below_one=True)
    check_hyper(name, "eps", eps)
    check_hyper(name, "weight_decay", weight_decay)

    def init_fn(params):
        _check_eps_fits(name, eps, params)
        zeros = tree_map_n(ops.zeros_like, params)
        return {"count": new_count(), "mu": zeros, "nu": tree_map_n(ops.zeros_like, params)}

    def transform(grads, state, params):
        check_state(name, state, params, ("mu", "nu"))
        count = state["count"]
        rate = learning_rate(lr, count)
        t = ops.astype(count + 1, "f64")
        correction1 = 1.0 - b1**t
        root_correction2 = ops.sqrt(1.0 - b2**t)
        if weight_decay and not decoupled:
            grads = tree_map_n(lambda g, p: g + p * weight_decay, grads, params)
        mu = tree_map_n(lambda m, g: m * b1 + g * (1.0 - b1), state["mu"], grads)
        nu = tree_map_n(lambda v, g: v * b2 + g * g * (1.0 - b2), state["nu"], grads)
        step_size = rate / correction1

        def update(m, v, p):
            denom = ops.sqrt(v) / leaf_scalar(root_correction2, v) + eps
            delta = -(m / denom * leaf_scalar(step_size, m))
            if weight_decay and decoupled:
                delta = delta - p * leaf_scalar(rate * weight_decay, p)
            return delta

        updates = tree_map_n(update, mu, nu, params)
        return updates, {"count": count + 1, "mu": mu, "nu": nu}

    return Optimizer(f"{name}({lr_text(lr)})", init_fn, transform, elementwise=True)


def _check_eps_fits(name: str, eps: float, params) -> None:
    """eps is added in the parameter's dtype: in float16 the default 1e-8 rounds to 0, and every
    element whose gradient is 0 then steps by 0 / 0, NaN, on the first update (torch.optim.Adam
    does the same, silently). Refused with the two ways out."""
    if np.float16(eps) != 0:
        return
    halves = [leaf for leaf in flatten(params)[0] if getattr(leaf, "dtype", None) == np.float16]
    if halves:
        raise ValueError(
            f"bp.optim.{name}: eps={eps!r} rounds to 0 in float16, the dtype of "
            f"{len(halves)} parameter(s), so an element whose gradient is 0 would become NaN on "
            f"the first step: pass master_dtype=bp.float32 (moments and steps in float32) or "
            f"an eps float16 holds (1e-4 is usual)"
        )
