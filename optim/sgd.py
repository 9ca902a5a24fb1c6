"""SGD with momentum, Nesterov momentum and L2 weight decay, as torch.optim.SGD (dampening 0):

d = g + weight_decay * p
buf = momentum * buf + d            (buf starts at zero, so the first buf is d)
d = d + momentum * buf if nesterov else buf
p = p - lr * d
"""

from __future__ import annotations

from backplan.tracer import ops

from .base import Optimizer, with_master
from .hyper import leaf_scalar, learning_rate, lr_text, new_count
from .tree import check_hyper, check_state, tree_map_n


def sgd(
    lr, momentum: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0, master_dtype=None
):
    """lr: a float (a traced float inside a compiled step is fine) or a schedule
    `lambda step: ...` of the step count. master_dtype=bp.float32 keeps float32 master weights
    of 16-bit parameters in the state (optim/master.py).

    >>> import backplan as bp
    >>> params = {"w": bp.tensor([1.0, 2.0])}
    >>> opt = bp.optim.sgd(0.5)
    >>> state = opt.init(params)
    >>> params, state = opt.update({"w": bp.tensor([1.0, 1.0])}, state, params)
    >>> params["w"].tolist()
    [0.5, 1.5]
    """
    check_hyper("sgd", "lr", lr)
    check_hyper("sgd", "momentum", momentum)
    check_hyper("sgd", "weight_decay", weight_decay)
    if nesterov and momentum == 0:
        raise ValueError("bp.optim.sgd: nesterov=True needs a momentum above 0")

    def init_fn(params):
        state = {"count": new_count()}
        if momentum:
            state["momentum"] = tree_map_n(ops.zeros_like, params)
        return state

    def transform(grads, state, params):
        check_state("sgd", state, params, ("momentum",) if momentum else ())
        rate = learning_rate(lr, state["count"])

        def direction(g, p):
            return g + p * leaf_scalar(weight_decay, p) if weight_decay else g

        d = tree_map_n(direction, grads, params)
        new_state = {"count": state["count"] + 1}
        if momentum:
            buf = tree_map_n(lambda b, d: b * momentum + d, state["momentum"], d)
            new_state["momentum"] = buf
            d = tree_map_n(lambda d, b: d + b * momentum, d, buf) if nesterov else buf
        updates = tree_map_n(lambda d: -(d * leaf_scalar(rate, d)), d)
        return updates, new_state

    name = f"sgd({lr_text(lr)}" + (f", momentum={momentum}" if momentum else "") + ")"
    return with_master(Optimizer(name, init_fn, transform, elementwise=True), master_dtype)
