"""Learning-rate schedules: functions of the step count (a 0-d int tensor in the optimizer
state, counting the updates done before this one), built from backplan ops so they run inside
a compiled step without retracing as the count grows.

>>> import backplan as bp
>>> schedule = bp.optim.cosine_decay(0.1, decay_steps=100)
>>> round(float(schedule(50)), 6)
0.05
"""

from __future__ import annotations

import math

import numpy as np

from backplan.tracer import ops
from backplan.tracer.tensor import Tensor


def _count(step) -> Tensor:
    """The step as a tensor; a negative one is refused where its value is known (a Python int or
    a concrete tensor): the formulas would give a rate below init_value, or a negative one."""
    if isinstance(step, Tensor):
        if step._data is not None and np.any(step._data < 0):
            raise ValueError(f"a schedule takes a step count of at least 0, got {step.tolist()}")
        return step
    if isinstance(step, int | np.integer) and not isinstance(step, bool):
        if step < 0:
            raise ValueError(f"a schedule takes a step count of at least 0, got {step}")
        return ops.tensor(np.int64(step))
    raise TypeError(f"a schedule takes the step count (an int or a 0-d int tensor), got {step!r}")


def cosine_decay(init_value: float, decay_steps: int, alpha: float = 0.0):
    """init_value * ((1 - alpha) * 0.5 * (1 + cos(pi * min(step, decay_steps) / decay_steps))
    + alpha), as optax.cosine_decay_schedule: from init_value down to alpha * init_value."""
    if decay_steps <= 0:
        raise ValueError(f"cosine_decay: decay_steps must be positive, got {decay_steps}")

    def schedule(step):
        count = ops.astype(_count(step), "f64")
        fraction = ops.minimum(count, float(decay_steps)) / float(decay_steps)
        cosine = 0.5 * (1.0 + ops.cos(fraction * math.pi))
        return init_value * ((1.0 - alpha) * cosine + alpha)

    schedule.__name__ = f"cosine_decay({init_value}, {decay_steps})"
    return schedule


def warmup_linear(peak_value: float, warmup_steps: int, init_value: float = 0.0):
    """Linear from init_value at step 0 to peak_value at warmup_steps, then peak_value."""
    if warmup_steps <= 0:
        raise ValueError(f"warmup_linear: warmup_steps must be positive, got {warmup_steps}")

    def schedule(step):
        count = ops.astype(_count(step), "f64")
        fraction = ops.minimum(count, float(warmup_steps)) / float(warmup_steps)
        return init_value + (peak_value - init_value) * fraction

    schedule.__name__ = f"warmup_linear({peak_value}, {warmup_steps})"
    return schedule
