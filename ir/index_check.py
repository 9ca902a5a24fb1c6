"""Index checks shared by the reference ops and the compiled kernels, so both raise the same
message: the bad value, its position in the index array, and the valid range.

>>> check_in_range(np.array([[0, 1], [2, -1]]), 0, 3, label_message)
Traceback (most recent call last):
IndexError: label -1 at position (1, 1) is out of range for 3 classes
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def index_message(value, position, size) -> str:
    return f"index {value} at position {position} is out of range for an axis of size {size}"


def label_message(value, position, classes) -> str:
    return f"label {value} at position {position} is out of range for {classes} classes"


def format_position(flat: int, shape: tuple) -> str:
    """The position of element `flat` (C order) of an array of `shape`, as NumPy would index it:
    `3` for a vector, `(1, 2)` for a matrix."""
    if len(shape) == 0:
        return "()"
    position = tuple(int(i) for i in np.unravel_index(int(flat), shape))
    return str(position[0]) if len(shape) == 1 else str(position)


def check_in_range(idx: np.ndarray, low: int, high: int, message: Callable) -> None:
    """Raise IndexError naming the first element outside [low, high); message(value, position,
    bound) words it, bound being high."""
    if idx.size and (idx.min() < low or idx.max() >= high):
        flat = int(np.flatnonzero((idx.reshape(-1) < low) | (idx.reshape(-1) >= high))[0])
        value = idx.reshape(-1)[flat]
        raise IndexError(message(value, format_position(flat, idx.shape), high))
