"""Gradient accumulation: `accumulate(opt, steps=k)` adds up the gradients of k updates and
applies the wrapped optimizer once, every k-th update, to their mean; the k - 1 updates between
return the parameters and the wrapped state unchanged. With k micro-batches of equal rows the
mean of their mean gradients is the mean gradient of the k micro-batches as one batch, so k
updates on micro-batches step as one update on the big batch would (to rounding).

    opt = bp.optim.accumulate(bp.optim.adam(1e-3), steps=4)
    state = opt.init(params)                          # {"micro", "grads", "inner"}
    params, state = opt.update(grads, state, params)  # steps every 4th call

Eagerly the k - 1 calls between updates skip the wrapped optimizer; inside @bp.compile (where the
call count is traced) the update is computed every call and selected with where.

The gradients of 16-bit parameters are summed in float32 (state["grads"] is float32 for them):
a bfloat16 running sum keeps 8 bits and rounded each of the k - 1 additions, where one big
batch's gradient is rounded once. Their mean is rounded into the parameter's dtype once, before
the wrapped optimizer (with master_dtype it takes the float32 mean as it is).
"""

from __future__ import annotations

from backplan.ir.types import is_half
from backplan.runtime import no_grad
from backplan.tracer import ops
from backplan.tracer.pytree import flatten, unflatten

from .base import Optimizer
from .hyper import new_count
from .tree import check_wrapper_state, tree_map_n

STATE_KEYS = ("micro", "grads", "inner")


class Accumulate(Optimizer):
    """An optimizer that applies `inner` to the mean of every `steps` gradients."""

    def __init__(self, inner: Optimizer, steps: int):
        super().__init__(
            f"accumulate({inner.name}, steps={steps})",
            inner.init,
            None,
            elementwise=inner.elementwise,
        )
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "steps", steps)

    def init(self, params):
        """{"micro": updates since the last step (0-d int64), "grads": their gradients' sum
        (float32 for 16-bit parameters), "inner": the wrapped optimizer's state}."""
        with no_grad():
            return {
                "micro": new_count(),
                "grads": tree_map_n(_zero_sum, params),
                "inner": self.inner.init(params),
            }

    def update(self, grads, state, params):
        """(new params, new state): unchanged params until the steps-th call of the round."""
        check_wrapper_state(self.name, state, STATE_KEYS, grads, params)
        _check_sums(state["grads"], params, f"{self.name}.update(grads, state, params)")
        with no_grad():
            return self.step(grads, state, params)

    def step(self, grads, state, params):
        total = tree_map_n(lambda s, g: s + ops.astype(g, s._ir_dtype), state["grads"], grads)
        micro = state["micro"] + 1
        if micro._data is not None:  # eager: the count is known
            if int(micro._data) < self.steps:
                return params, {"micro": micro, "grads": total, "inner": state["inner"]}
            return self._apply(total, state, params)
        stepped, applied = self._apply(total, state, params)
        due = micro >= self.steps
        return _select(due, stepped, params), _select(
            due, applied, {**state, "grads": total, "micro": micro}
        )

    def _apply(self, total, state, params):
        keep = self.inner.master_dtype is not None  # it widens the mean to float32 itself
        mean = tree_map_n(
            lambda s, p: s / self.steps if keep else ops.astype(s / self.steps, p._ir_dtype),
            total,
            params,
        )
        params, inner = self.inner.step(mean, state["inner"], params)
        fresh = {
            "micro": ops.zeros_like(state["micro"]),
            "grads": tree_map_n(ops.zeros_like, total),
        }
        return params, {**fresh, "inner": inner}


def _summed_dtype(param) -> str:
    """The dtype a parameter's gradients are summed in: float32 for 16-bit floats."""
    return "f32" if is_half(param._ir_dtype) else param._ir_dtype


def _zero_sum(param):
    return ops.zeros(param.shape, _summed_dtype(param))


def _check_sums(sums, params, where: str) -> None:
    """state["grads"] holds a sum per parameter, of its shape, in its summed dtype."""
    leaves, treedef, paths = flatten(sums, paths=True)
    p_leaves, p_treedef = flatten(params)
    if treedef != p_treedef:
        raise TypeError(
            f"{where}: state['grads'] and params have different structures; pass the state "
            "init(params) built for these params"
        )
    for s, p, path in zip(leaves, p_leaves, paths, strict=True):
        if s.shape != p.shape or s._ir_dtype != _summed_dtype(p):
            raise TypeError(
                f"{where}: state['grads']{path} is {s._ir_dtype}{list(s.shape)} but the sum "
                f"of param {path}'s gradients is {_summed_dtype(p)}{list(p.shape)}; pass the "
                "state init(params) built for these params"
            )


def _select(due, when_due, otherwise):
    """Leaf by leaf: when_due where due (a traced 0-d bool), else otherwise."""
    a, treedef = flatten(when_due)
    b, _ = flatten(otherwise)
    return unflatten(treedef, [ops.where(due, x, y) for x, y in zip(a, b, strict=True)])


def accumulate(optimizer: Optimizer, steps: int) -> Accumulate:
    """Apply optimizer every `steps` updates to the mean of their gradients (see the module
    docstring); wrap a whole optimizer (a chain, master weights included).

    >>> import backplan as bp
    >>> params = {"w": bp.tensor([1.0])}
    >>> opt = bp.optim.accumulate(bp.optim.sgd(1.0), steps=2)
    >>> state = opt.init(params)
    >>> params, state = opt.update({"w": bp.tensor([1.0])}, state, params)
    >>> params["w"].tolist()
    [1.0]
    >>> params, state = opt.update({"w": bp.tensor([3.0])}, state, params)
    >>> params["w"].tolist()
    [-1.0]
    """
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"bp.optim.accumulate wraps an optimizer (bp.optim.adam(...)), got "
            f"{type(optimizer).__name__}"
        )
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"bp.optim.accumulate: steps must be a whole number >= 1, got {steps!r}")
    return Accumulate(optimizer, steps)
