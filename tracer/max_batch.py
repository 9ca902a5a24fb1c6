"""bp.max_batch: the largest batch whose step fits a memory budget, found by planning alone.

Each candidate batch is traced and planned under the budget (tracer/budget.py), nothing runs or
compiles; a doubling search finds an upper bound, then a bisection the largest batch that fits.
The batch arguments are given again at each size as C-ordered arrays of zeros of their dtype,
so the plans see the dtypes, shapes and layout a real batch would have: tracing reads no
values. Large zeros are mapped by calloc and never touched, so a search up to MAX_BATCH rows
holds no more memory than its plans (repeating the rows wrote every candidate's batch: 4 GiB
and minutes for 64 float32 features at 2^24 rows, where the budget was generous).
"""

from __future__ import annotations

import operator
import warnings

import numpy as np

from backplan.ir.errors import MemoryBudgetError, ShapeError

from .budget import brief_refusals, checked_budget
from .compile import CompiledFunction
from .pytree import flatten, unflatten
from .tensor import Tensor

MAX_BATCH = 2**24


def max_batch(fn, args, max_peak_bytes: int, axis: int = 0) -> int:
    """The largest batch (size along `axis` of the data arguments) whose step, compiled with
    max_peak_bytes (fn.with_budget: the plan a budget picks runs on every call), fits it; 0 if
    not even one example fits. fn called without the budget may hold more: a small compiled
    loss that backward() follows runs one joint plan from its third call (report.call_peaks).
    fn is a bp.compile, bp.value_and_grad or bp.grad function (or a plain function, compiled
    here); args the arguments of one call. Data arguments are those not differentiated
    (value_and_grad's argnums) or, for bp.compile, the tensors and arrays that need no
    gradient outside donate_argnums (a training step's parameters and optimizer state); the
    batch is the size along axis of the largest of their leaves, and every data leaf of that
    size is resized. The budget bounds the step's peak as explain prints it (peak_bytes: every
    result counted as kept until the next call returns), not the lower one a loop passing its
    results back in without donating them holds (report.observed_peak_bytes).

    >>> import numpy as np, backplan as bp
    >>> step = bp.value_and_grad(lambda w, x: bp.tanh(x @ w).sum())
    >>> w, x = bp.tensor(np.ones((8, 8), np.float32)), bp.tensor(np.ones((4, 8), np.float32))
    >>> bp.max_batch(step, (w, x), max_peak_bytes=4096) < bp.max_batch(step, (w, x), 8192)
    True
    """
    limit = checked_budget(max_peak_bytes, "max_peak_bytes")
    if not hasattr(fn, "with_budget"):
        fn = CompiledFunction(fn)
    if not isinstance(args, tuple | list):  # an array here would be taken row by row
        what = getattr(args, "shape", None)
        raise TypeError(
            f"max_batch: args is the tuple of the function's arguments for one call, got "
            f"{type(args).__name__}{'' if what is None else f' of shape {tuple(what)}'}; "
            "for a function of one argument pass (x,)"
        )
    axis = _checked_axis(axis)
    resize = _batch_resizer(fn, tuple(args), axis)

    def fits(batch: int) -> bool:
        try:
            with brief_refusals():  # the refusal's words are not read
                fn.with_budget(limit).trace(*resize(batch))
        except MemoryBudgetError:
            return False
        except ShapeError as error:
            raise ShapeError(
                f"max_batch: with {batch} rows along axis {axis} of {resize.describe()} the "
                f"function fails: {error}. max_batch resizes the data leaves whose axis {axis} "
                f"is the batch's ({resize.size}); parameters are the arguments differentiated "
                "or donated (donate_argnums) and tensors that require grad"
            ) from error
        return True

    low, high = 0, resize.size  # fits(low) holds (0 trivially); high is the next to try
    while high <= MAX_BATCH and fits(high):
        low, high = high, high * 2
    capped = high > MAX_BATCH
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    if capped and low == high - 1:  # every size tried fits: low is a lower bound only
        warnings.warn(
            f"max_batch: every batch up to {low:,} rows fits in {limit:,} bytes; the search "
            f"stops there (larger batches were not planned), so the largest that fits may be "
            "larger",
            stacklevel=2,
        )
    return low


def _checked_axis(axis) -> int:
    if isinstance(axis, bool):
        raise TypeError(f"max_batch: axis must be an integer, got {axis!r}")
    try:
        return operator.index(axis)
    except TypeError:
        raise TypeError(
            f"max_batch: axis must be an integer (the batch axis of the data arguments), got "
            f"{axis!r} of type {type(axis).__name__}"
        ) from None


class _Resizer:
    def __init__(self, args, treedefs, positions, size, axis):
        self.args, self.treedefs, self.positions = args, treedefs, positions
        self.size, self.axis = size, axis

    def describe(self) -> str:
        """Which leaves are resized: 'argument 2 (leaf 0), argument 3 (leaf 0)'."""
        return ", ".join(
            f"argument {i} (leaf {', '.join(map(str, sorted(leaves)))})"
            for i, leaves in sorted(self.positions.items())
        )

    def __call__(self, batch: int) -> tuple:
        new = []
        for i, (arg, (leaves, treedef)) in enumerate(zip(self.args, self.treedefs, strict=True)):
            if i not in self.positions:
                new.append(arg)
                continue
            leaves = [
                _resized(leaf, batch, self.axis) if k in self.positions[i] else leaf
                for k, leaf in enumerate(leaves)
            ]
            new.append(unflatten(treedef, leaves))
        return tuple(new)


def _resized(leaf, batch: int, axis: int):
    """Zeros of leaf's dtype with `batch` along axis, C-ordered as a new batch array is."""
    shape = list(leaf.shape)
    shape[axis] = batch
    dtype = leaf.numpy().dtype if isinstance(leaf, Tensor) else np.asarray(leaf).dtype
    zeros = np.zeros(shape, dtype)
    return Tensor._from_array(zeros) if isinstance(leaf, Tensor) else zeros


def _batch_resizer(fn, args: tuple, axis: int) -> _Resizer:
    """Resizes the data leaves whose size along axis is the batch's: that of the largest data
    leaf (a random key or a lookup table beside the batch keeps its shape)."""
    treedefs, found = [], []
    for i, arg in enumerate(args):
        leaves, treedef = flatten(arg)
        treedefs.append((leaves, treedef))
        for k, leaf in enumerate(leaves):
            shape = getattr(leaf, "shape", None)
            if shape is not None and -len(shape) <= axis < len(shape) and fn.batch_leaf(i, leaf):
                found.append((np.prod(shape), i, k, shape[axis]))
    if not found:
        raise ValueError(
            f"max_batch: no argument has data with an axis {axis} to resize (the arguments "
            "differentiated, and tensors that require grad, are parameters)"
        )
    size = max(found)[3]
    if size == 0:  # doubling from 0 never grows: the search looped forever
        raise ValueError(
            f"max_batch: the data's axis {axis} is empty (size 0), so there is no example to "
            "repeat into larger batches; pass the arguments of a real call (at least one row)"
        )
    positions: dict[int, set] = {}
    for _, i, k, length in found:
        if length == size:
            positions.setdefault(i, set()).add(k)
    return _Resizer(args, treedefs, positions, size, axis)
