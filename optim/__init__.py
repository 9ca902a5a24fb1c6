"""backplan.optim: optimizers as pure functions of (grads, state, params), optax-style, so they
run eagerly and inside a compiled training step alike.

>>> import backplan as bp
>>> params = {"w": bp.tensor([1.0, 2.0])}
>>> opt = bp.optim.chain(bp.optim.clip_by_global_norm(1.0), bp.optim.sgd(0.1, momentum=0.9))
>>> state = opt.init(params)
>>> params, state = opt.update({"w": bp.tensor([3.0, 4.0])}, state, params)
>>> [round(x, 3) for x in params["w"].tolist()]
[0.94, 1.92]
"""

from .accumulate import Accumulate, accumulate
from .adam import adam, adamw
from .base import Optimizer, apply_updates, chain
from .clip import clip_by_global_norm, global_norm
from .loss_scale import LossScale, loss_scale
from .master import PrecisionWarning
from .schedules import cosine_decay, warmup_linear
from .sgd import sgd

__all__ = [
    "Accumulate",
    "accumulate",
    "Optimizer",
    "adam",
    "adamw",
    "apply_updates",
    "chain",
    "clip_by_global_norm",
    "cosine_decay",
    "global_norm",
    "loss_scale",
    "LossScale",
    "PrecisionWarning",
    "sgd",
    "warmup_linear",
]
