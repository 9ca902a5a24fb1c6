"""How an argument's array is laid out, in the words explain and the signature use. A compiled
plan reads its inputs in C order; three other layouts are views of a C-ordered array, which a
plan reads in place (ir/in_place_inputs.py): "F-order" (the transpose of its C-ordered .T;
"axes permuted (1, 0, 2)" for other orders of the axes, a torch .permute()),
"broadcast over axis 0" (np.broadcast_to of the array with those axes cut to 1), "reversed
along axis 1" (a[::-1] of a C-ordered array). Any other ("strided": a slice with steps, mixed
kinds) is copied whole into C order at every call of a plan that takes it (codegen/run/
compiled.py `contiguous`), a copy the step's peak counts (ir/peak.py, category "copies"). The
signature keys on the layout (tracer/signature.py): a plan made for one is never reused for
another.

>>> import numpy as np
>>> a = np.ones((4, 3), np.float32)
>>> [layout(x) for x in (a, a.T, a[::-1], np.broadcast_to(a[0], (4, 3)), a[:, ::2])]
['C', 'F-order', 'reversed along axis 0', 'broadcast over axis 0', 'strided']
>>> t = np.ones((2, 3, 4), np.float32).transpose(1, 0, 2)
>>> layout(t), base(t, layout(t)).flags.c_contiguous, same_layout(t).strides == t.strides
('axes permuted (1, 0, 2)', True, True)
>>> column = np.ones((4, 1), np.float32)
>>> b = np.broadcast_to(column, (4, 3))
>>> layout(b), np.shares_memory(base(b, layout(b)), column), same_layout(b).strides
('broadcast over axis 1', True, (4, 0))
"""

from __future__ import annotations

import numpy as np

C_ORDER = "C"
F_ORDER = "F-order"
BROADCAST = "broadcast over"
REVERSED = "reversed along"
PERMUTED = "axes permuted"  # "axes permuted (1, 0, 2)": a.transpose(1, 0, 2) of a C array


def _permutation(array: np.ndarray) -> tuple[int, ...] | None:
    """p with array == c.transpose(p) for a C-ordered c (a torch .permute() of a contiguous
    tensor), or None: the axes ordered by falling stride (C order ignores size-1 axes)."""
    if array.ndim < 3 or any(
        s <= 0 for s, n in zip(array.strides, array.shape, strict=True) if n > 1
    ):
        return None
    order = tuple(sorted(range(array.ndim), key=lambda k: (-array.strides[k], k)))
    if not array.transpose(order).flags.c_contiguous:
        return None
    return tuple(int(k) for k in np.argsort(order))


def layout(array: np.ndarray) -> str:
    """C_ORDER ("C") for an array a plan reads as it is (C-contiguous, however aligned);
    otherwise F-order, broadcast over / reversed along the axes named (where the rest is C
    order), or "strided"."""
    if array.flags.c_contiguous:
        return C_ORDER
    if array.flags.f_contiguous:
        return F_ORDER
    perm = _permutation(array)
    if perm is not None:
        return f"{PERMUTED} {perm}"
    sized = [
        (k, s) for k, (s, n) in enumerate(zip(array.strides, array.shape, strict=True)) if n > 1
    ]
    zero = [k for k, s in sized if s == 0]
    negative = [k for k, s in sized if s < 0]
    if zero and not negative and _cut(array, zero).flags.c_contiguous:
        return _named(BROADCAST, zero)
    if negative and not zero and _flipped(array, negative).flags.c_contiguous:
        return _named(REVERSED, negative)
    return "strided"


def _named(kind: str, axes: list[int]) -> str:
    which = "axis" if len(axes) == 1 else "axes"
    return f"{kind} {which} {', '.join(map(str, axes))}"


def layout_axes(word: str) -> tuple[int, ...]:
    """The axes a broadcast or reversed layout names; a permuted one's permutation."""
    if word.startswith(PERMUTED):
        return tuple(int(a) for a in word[len(PERMUTED) + 2 : -1].split(",") if a.strip())
    return tuple(int(a) for a in word.split(" ", 3)[3].split(", "))


def _cut(array: np.ndarray, axes) -> np.ndarray:
    return array[tuple(slice(0, 1) if k in axes else slice(None) for k in range(array.ndim))]


def _flipped(array: np.ndarray, axes) -> np.ndarray:
    return array[
        tuple(slice(None, None, -1) if k in axes else slice(None) for k in range(array.ndim))
    ]


def base(array: np.ndarray, word: str) -> np.ndarray:
    """The C-ordered array (a view, where `array` has that layout) a plan reading `array` in
    place takes instead: array.T, the broadcast axes cut to 1, the reversed axes flipped back."""
    if word == F_ORDER:
        return array.T
    if word.startswith(PERMUTED):
        return array.transpose(np.argsort(layout_axes(word)))
    if word.startswith(BROADCAST):
        return _cut(array, layout_axes(word))
    if word.startswith(REVERSED):
        return _flipped(array, layout_axes(word))
    return array


def viewed(base_array: np.ndarray, word: str, shape: tuple) -> np.ndarray:
    """The array of this layout and shape that views `base_array` (what `base` undoes)."""
    if word == F_ORDER:
        return base_array.T
    if word.startswith(PERMUTED):
        return base_array.transpose(layout_axes(word))
    if word.startswith(BROADCAST):
        return np.broadcast_to(base_array, shape)
    if word.startswith(REVERSED):
        return _flipped(base_array, layout_axes(word))
    return base_array


def same_layout(array: np.ndarray) -> np.ndarray:
    """A private copy of `array` in its own layout, its C-ordered base copied and viewed back:
    an F-order array stays F-order, a broadcast view is copied at its compact size and
    broadcast again (read-only), a reversed view reversed; any other becomes C-ordered."""
    word = layout(array)
    return viewed(np.array(base(array, word), order="C"), word, array.shape)


def copied_inputs(layouts) -> tuple[tuple[int, str], ...]:
    """(input index, layout) of each input a plan copies, from the inputs' layouts in order."""
    return tuple((i, word) for i, word in enumerate(layouts) if word != C_ORDER)
