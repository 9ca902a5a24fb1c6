"""Parameter initialisers with PyTorch's fan conventions, drawn from bp.random keys.

For a weight (out, in, *kernel) fan_in = in * prod(kernel), fan_out = out * prod(kernel); a
linear weight stored (in, out) for `x @ w`, the way backplan models usually store it, is given as
shape (in, out) with `fan="in_out"`.
"""

from __future__ import annotations

import math

from . import random

RELU_GAIN = math.sqrt(2.0)


def fans(shape, layout: str = "out_in") -> tuple[int, int]:
    """(fan_in, fan_out) of a weight shape, as torch.nn.init._calculate_fan_in_and_fan_out."""
    shape = tuple(shape)
    if len(shape) < 2:
        raise ValueError(f"fan in and fan out need a weight of at least 2 dimensions, got {shape}")
    if layout not in ("out_in", "in_out"):
        raise ValueError(f"layout must be 'out_in' (PyTorch) or 'in_out' (x @ w), got {layout!r}")
    receptive = math.prod(shape[2:])
    first, second = shape[0] * receptive, shape[1] * receptive
    return (second, first) if layout == "out_in" else (first, second)


def kaiming_normal(key, shape, dtype="float32", layout: str = "out_in", gain=RELU_GAIN):
    """Normal(0, gain / sqrt(fan_in)): He initialisation for ReLU layers (torch's
    kaiming_normal_ with mode='fan_in', nonlinearity='relu')."""
    fan_in, _ = fans(shape, layout)
    return random.normal(key, shape, dtype) * (gain / math.sqrt(fan_in))


def xavier_uniform(key, shape, dtype="float32", layout: str = "out_in", gain=1.0):
    """Uniform(-a, a) with a = gain * sqrt(6 / (fan_in + fan_out)) (torch's xavier_uniform_)."""
    fan_in, fan_out = fans(shape, layout)
    bound = gain * math.sqrt(6.0 / (fan_in + fan_out))
    return random.uniform(key, shape, dtype, -bound, bound)
