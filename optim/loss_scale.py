"""Dynamic loss scaling for float16 training, as torch.cuda.amp.GradScaler does it.

float16 gradients underflow to zero below about 6e-8; multiplying the loss by a large scale
moves them into range. `loss_scale(opt)` wraps an optimizer: its state says the scale to multiply
the loss by, its `update` takes the gradients of the scaled loss, unscales them (in float32),
and when any is not finite (inf or NaN: the scale overflowed) skips the step, leaving parameters
and the wrapped state unchanged, halving the scale and counting the skip. After
`growth_interval` finite steps in a row the scale doubles.

    opt = bp.optim.loss_scale(bp.optim.adam(1e-3, master_dtype=bp.float32))
    state = opt.init(params)

    @bp.compile(donate_argnums=(0, 1))
    def step(params, state, x, y):
        loss, grads = bp.value_and_grad(lambda p: loss_fn(p, x, y) * state["scale"])(params)
        params, state = opt.update(grads, state, params)
        return params, state, loss / state["scale"]
"""

from __future__ import annotations

from backplan.runtime import no_grad
from backplan.tracer import ops
from backplan.tracer.pytree import flatten, unflatten

from .base import Optimizer
from .tree import check_hyper, check_wrapper_state

STATE_KEYS = ("scale", "good_steps", "skipped", "inner")


class LossScale(Optimizer):
    """An optimizer with dynamic loss scaling around `inner` (see the module docstring)."""

    def __init__(self, inner: Optimizer, init_scale, growth_interval, growth, backoff):
        super().__init__(f"loss_scale({inner.name})", inner.init, None)
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "settings", (init_scale, growth_interval, growth, backoff))

    def init(self, params):
        """{"scale": float32 0-d, "good_steps": finite steps since the scale last changed,
        "skipped": steps skipped so far, "inner": the wrapped optimizer's state}."""
        return {
            "scale": ops.full((), self.settings[0], "float32"),
            "good_steps": ops.full((), 0, "int64"),
            "skipped": ops.full((), 0, "int64"),
            "inner": self.inner.init(params),
        }

    def update(self, grads, state, params):
        """(new params, new state); grads are those of the loss times state["scale"]."""
        check_wrapper_state(self.name, state, STATE_KEYS, grads, params)
        with no_grad():
            return self._scaled_step(grads, state, params)

    def _scaled_step(self, grads, state, params):
        _, interval, growth, backoff = self.settings
        scale = state["scale"]
        unscaled = _unscaled(grads, scale, self.inner.master_dtype is not None)
        finite = _all_finite(unscaled)
        stepped, inner = self.inner.step(unscaled, state["inner"], params)
        good = ops.where(finite, state["good_steps"] + 1, 0)
        grow = good >= interval
        new_state = {
            "scale": ops.where(finite, ops.where(grow, scale * growth, scale), scale * backoff),
            "good_steps": ops.where(grow, 0, good),
            "skipped": ops.where(finite, state["skipped"], state["skipped"] + 1),
            "inner": _select(finite, inner, state["inner"]),
        }
        return _kept_flags(_select(finite, stepped, params), params), new_state


def loss_scale(
    optimizer: Optimizer,
    init_scale: float = 2.0**15,
    growth_interval: int = 2000,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
) -> LossScale:
    """Wrap optimizer with dynamic loss scaling (float16 training; see optim/loss_scale.py).

    >>> import backplan as bp, numpy as np
    >>> params = {"w": bp.tensor(np.ones(2, np.float16))}
    >>> opt = bp.optim.loss_scale(bp.optim.sgd(0.1, master_dtype=bp.float32), init_scale=4.0)
    >>> state = opt.init(params)
    >>> inf = bp.tensor(np.array([np.inf, 1.0], np.float16))
    >>> params, state = opt.update({"w": inf}, state, params)  # skipped: scale halved
    >>> params["w"].tolist(), state["scale"].item(), state["skipped"].item()
    ([1.0, 1.0], 2.0, 1)
    """
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"bp.optim.loss_scale wraps an optimizer, got {type(optimizer).__name__}")
    check_hyper("loss_scale", "init_scale", init_scale, positive=True)
    check_hyper("loss_scale", "growth_factor", growth_factor, positive=True)
    check_hyper("loss_scale", "backoff_factor", backoff_factor, positive=True)
    if not isinstance(growth_interval, int) or growth_interval < 1:
        raise ValueError(
            f"bp.optim.loss_scale: growth_interval={growth_interval!r}; use an int >= 1"
        )
    return LossScale(optimizer, init_scale, growth_interval, growth_factor, backoff_factor)


def _unscaled(grads, scale, keep_float32: bool):
    """grads / scale computed in float32; back in each gradient's dtype unless the wrapped
    optimizer keeps master weights (it casts them up anyway, and small ones survive)."""
    leaves, treedef = flatten(grads)
    inverse = 1.0 / scale
    out = []
    for g in leaves:
        value = ops.astype(g, "f32") * inverse
        out.append(
            value if keep_float32 or g._ir_dtype == "f32" else ops.astype(value, g._ir_dtype)
        )
    return unflatten(treedef, out)


def _all_finite(tree):
    """A 0-d bool: no leaf holds an inf or a NaN (|g| < inf is false for both), counted in
    int64 so that no count of elements rounds."""
    finite, size = None, 0
    for leaf in flatten(tree)[0]:
        count = ops.sum(ops.astype(ops.abs(leaf) < float("inf"), "i64"))
        finite = count if finite is None else finite + count
        size += leaf.size
    return finite == size


def _select(finite, new, old):
    """new where every gradient was finite, else old, leaf by leaf."""
    new_leaves, treedef = flatten(new)
    old_leaves = flatten(old)[0]
    return unflatten(
        treedef, [ops.where(finite, n, o) for n, o in zip(new_leaves, old_leaves, strict=True)]
    )


def _kept_flags(new, params):
    """Eagerly, new parameters keep the old requires_grad flags (as Optimizer.update)."""
    for n, p in zip(flatten(new)[0], flatten(params)[0], strict=True):
        if p._data is not None and p.requires_grad:
            n.requires_grad = True
    return new
