"""Central differences of a float64 scalar function, for gradient checks."""

import numpy as np


def central_differences(loss, x: np.ndarray, h: float = 1e-6) -> np.ndarray:
    """d loss(x) / dx, one element at a time, by (loss(x + h) - loss(x - h)) / 2h."""
    numeric = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        plus, minus = x.copy(), x.copy()
        plus[i] += h
        minus[i] -= h
        numeric[i] = (loss(plus) - loss(minus)) / (2 * h)
    return numeric
