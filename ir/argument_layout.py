"""How an argument's array is laid out, in the words explain and the signature use. A compiled
plan reads its inputs in C order; three other layouts are views of a C-ordered array, which a
plan reads in place (ir/in_place_inputs.py): "F-order" (the transpose of its C-ordered .T;
"axes permuted (1, 0, 2)" for other orders of the axes, a torch .permute()),
"broadcast over axis 0" (np.broadcast_to of the array with those axes cut to 1), "reversed
along axis 1" (a[::-1] of a C-ordered array). Any other view whose root (the array at the end
of its .base chain) is C-ordered is "sliced" (a[:, ::2], a column slice a[:, :3], every other
row, mixed kinds): a slice of a C-ordered span of that root, its axes then permuted and
broadcast (the word names the slice, the span's shape, the order and whether it broadcasts, so
a plan is exact for it), where the span is at most SPAN_LIMIT times the view's elements. Any
other ("strided": a view of a torch tensor, overlapping strides, strides not in whole items,
a view that is mostly gaps) is copied whole into C order at every call of a plan that takes it
(codegen/run/compiled.py `contiguous`), a copy the step's peak counts (ir/peak.py, category
"copies"). The signature keys on the layout (tracer/signature.py): a plan made for one is never
reused for another (a slice at another place of its root can be another word: its span shifts).

>>> import numpy as np
>>> a = np.ones((4, 3), np.float32)
>>> [layout(x) for x in (a, a.T, a[::-1], np.broadcast_to(a[0], (4, 3)))]
['C', 'F-order', 'reversed along axis 0', 'broadcast over axis 0']
>>> layout(a[:, ::2])
'sliced [0:4:1, 0:3:2] of a 4 x 3 array'
>>> layout(a[1:, 1:][::-1].T)
'sliced [2:-1:-1, 1:3:1] of a 3 x 3 array, axes (1, 0)'
>>> v = a[1:, 1:][::-1].T
>>> span = base(v, layout(v))
>>> np.shares_memory(span, a), viewed(span, layout(v), v.shape).strides == v.strides
(True, True)
>>> t = np.ones((2, 3, 4), np.float32).transpose(1, 0, 2)
>>> layout(t), base(t, layout(t)).flags.c_contiguous, same_layout(t).strides == t.strides
('axes permuted (1, 0, 2)', True, True)
>>> column = np.ones((4, 1), np.float32)
>>> b = np.broadcast_to(column, (4, 3))
>>> layout(b), np.shares_memory(base(b, layout(b)), column), same_layout(b).strides
('broadcast over axis 1', True, (4, 0))
"""

from __future__ import annotations

import functools
import math
import re

import numpy as np

C_ORDER = "C"
F_ORDER = "F-order"
BROADCAST = "broadcast over"
REVERSED = "reversed along"
PERMUTED = "axes permuted"  # "axes permuted (1, 0, 2)": a.transpose(1, 0, 2) of a C array
STRIDED = "strided"  # any other view: copied into C order at every call
# a view is read as a slice of its span only where the span holds at most this many times its
# elements: a NumPy argument saved for backward (or read by an output) copies the span, and
# `inputs` counts it (a column a[:, :1] of a 4096-wide array would copy 4096 times its bytes)
SPAN_LIMIT = 2
SLICED = "sliced"  # "sliced [0:4:1, 1:3:1] of a 4 x 6 array, axes (1, 0), broadcast"


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
    return _sliced(array) or STRIDED


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
    if word.startswith(SLICED):
        return _span(array, word)
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
    if word.startswith(SLICED):
        span, starts, stops, steps, perm, broadcast = sliced_parts(word)
        view = base_array[_slices(starts, stops, steps)].transpose(perm)
        return np.broadcast_to(view, shape) if broadcast else view
    return base_array


def same_layout(array: np.ndarray) -> np.ndarray:
    """A private copy of `array` in its own layout, its C-ordered base copied and viewed back:
    an F-order array stays F-order, a broadcast view is copied at its compact size and
    broadcast again (read-only), a reversed view reversed, a sliced one with its span (the
    gaps between its elements too); any other becomes C-ordered."""
    word = layout(array)
    return viewed(np.array(base(array, word), order="C"), word, array.shape)


def any_size(word: str) -> str:
    """The word where an axis's size is a symbol (a dynamic axis): a SLICED word names its
    span's sizes, so such an argument is keyed "strided" and copied (any non-C array a plan
    keyed "strided" takes is); any other word names no size and stays."""
    return STRIDED if word.startswith(SLICED) else word


def sliced_shape(word: str) -> tuple:
    """The shape of the view a SLICED word names (broadcast axes at size 1)."""
    span, starts, stops, steps, perm, _ = sliced_parts(word)
    lengths = [len(range(*t)) for t in zip(starts, stops, steps, strict=True)]
    return tuple(lengths[k] for k in perm)


def stored_bytes(shape: tuple, itemsize: int, word: str) -> int:
    """The bytes of the C-ordered array under an argument of this shape and layout (base()):
    what the caller's array occupies, and what a copy in its own layout (same_layout) holds. A
    broadcast view its compact array, a sliced one its span (the gaps between its elements
    too), any other its own elements."""
    if word.startswith(BROADCAST):
        axes = layout_axes(word)
        shape = tuple(1 if k in axes else n for k, n in enumerate(shape))
    elif word.startswith(SLICED):
        shape = sliced_parts(word)[0]
    return int(np.prod(shape, dtype=np.int64)) * itemsize


def copied_inputs(layouts) -> tuple[tuple[int, str], ...]:
    """(input index, layout) of each input a plan copies, from the inputs' layouts in order."""
    return tuple((i, word) for i, word in enumerate(layouts) if word != C_ORDER)


def _root(array: np.ndarray) -> np.ndarray:
    """The array at the end of `array`'s chain of views: the memory known to be there."""
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array


def _one_block(root: np.ndarray) -> bool:
    """Whether root's memory is one block of root.nbytes from its first element (C or F
    order): the bytes a span may cover."""
    return root.flags.c_contiguous or root.flags.f_contiguous


def _address(array: np.ndarray) -> int:
    return array.ctypes.data  # a little cheaper than __array_interface__, which builds a dict


def _sliced(array: np.ndarray) -> str | None:
    """The SLICED word of `array`, or None where it is no slice of a C-ordered span inside its
    root (a C- or F-ordered array). The axes of size > 1 and stride != 0, by falling |stride|
    (s_0 > s_1 > ... elements), are a slice of a C-ordered span of shape (d_0, s_0 / s_1, ...,
    s_{m-2}): every step 1 but the last axis's, s_{m-1}; the span starts where the innermost
    axis leaves room for it to end inside the root (a column slice a[:, 1:3] spans whole rows
    of a). The other axes (size 1, broadcast) come last, of size 1; a transpose puts the axes
    back in order and a broadcast_to restores the broadcast ones."""
    item, shape, strides = array.itemsize, array.shape, array.strides
    root = _root(array)
    if array.size == 0 or not _one_block(root) or any(s % item for s in strides):
        return None
    offset = _address(array) - _address(root)  # of the first element, in the root's bytes
    return _sliced_word(shape, strides, item, offset, root.nbytes)


@functools.lru_cache(maxsize=1024)
def _sliced_word(shape: tuple, strides: tuple, item: int, offset: int, nbytes: int) -> str | None:
    """_sliced for a view of this shape and strides whose first element is `offset` bytes into
    a root of `nbytes`: the same for every call passing the same slice (kept)."""
    ndim = len(shape)
    real = sorted(
        (k for k in range(ndim) if shape[k] > 1 and strides[k] != 0),
        key=lambda k: (-abs(strides[k]), k),
    )
    s = [abs(strides[k]) // item for k in real]
    d = [shape[k] for k in real]
    m = len(real)
    if m == 1:
        span, steps = [(d[0] - 1) * s[0] + 1], [s[0]]
    elif m > 1:
        if any(s[j] % s[j + 1] for j in range(m - 2)):
            return None
        span = [d[0]] + [s[j - 1] // s[j] for j in range(1, m - 1)] + [s[m - 2]]
        steps = [1] * (m - 1) + [s[m - 1]]
        if any(d[j] > span[j] for j in range(1, m - 1)):
            return None
    else:
        span, steps = [], []
    if math.prod(span) > SPAN_LIMIT * math.prod(d):
        return None  # mostly gaps: copying the view costs less than holding or copying its span
    # the lowest element's byte offset in the root; the span's shift back from it (elements)
    low = offset + sum((shape[k] - 1) * strides[k] for k in real if strides[k] < 0)
    extent = math.prod(span) * item
    shift = max(0, -(-(low + extent - nbytes) // item))
    if low < 0 or shift * item > low or (m and (shift + (d[-1] - 1) * steps[-1] + 1 > span[-1])):
        return None
    firsts = [0] * m
    if m:
        firsts[-1] = shift
    slices = []
    for j, k in enumerate(real):
        first, last = firsts[j], firsts[j] + (d[j] - 1) * steps[j]
        if strides[k] < 0:
            slices.append(f"{last}:{first - 1}:{-steps[j]}")
        else:
            slices.append(f"{first}:{last + 1}:{steps[j]}")
    order = real + [k for k in range(ndim) if k not in real]
    slices += ["0:1:1"] * (ndim - m)
    sizes = span + [1] * (ndim - m)
    word = f"{SLICED} [{', '.join(slices)}] of a {' x '.join(map(str, sizes))} array"
    if order != sorted(order):
        word += f", axes ({', '.join(str(order.index(k)) for k in range(ndim))})"
    if any(strides[k] == 0 and shape[k] > 1 for k in range(ndim)):
        word += ", broadcast"
    return word


@functools.lru_cache(maxsize=256)
def sliced_parts(word: str) -> tuple:
    """(span shape, starts, stops, steps, perm, broadcast) a SLICED word names: the view is
    span[starts:stops:steps] (a stop of -1: before the first), transposed by perm, broadcast
    to the argument's shape if `broadcast`."""
    found = re.fullmatch(
        rf"{SLICED} \[(.*)\] of a ([\d x]*) array(?:, axes \(([\d, ]*)\))?(, broadcast)?", word
    )
    triples = [tuple(int(n) for n in part.split(":")) for part in found.group(1).split(", ")]
    span = tuple(int(n) for n in found.group(2).split(" x ")) if found.group(2) else ()
    n = len(triples)
    perm = tuple(int(k) for k in found.group(3).split(", ")) if found.group(3) else tuple(range(n))
    starts, stops, steps = (tuple(t[i] for t in triples) for i in range(3))
    return span, starts, stops, steps, perm, found.group(4) is not None


def _slices(starts, stops, steps) -> tuple:
    return tuple(
        slice(a, None if b < 0 else b, c) for a, b, c in zip(starts, stops, steps, strict=True)
    )


@functools.lru_cache(maxsize=256)
def span_offset(word: str) -> int:
    """Elements from the span's first to the view's lowest element."""
    span, starts, stops, steps, _, _ = sliced_parts(word)
    offset, stride = 0, 1
    for size, a, b, c in reversed(list(zip(span, starts, stops, steps, strict=True))):
        count = len(range(a, b, c))
        offset += (a if c > 0 else a + (count - 1) * c) * stride
        stride *= size
    return offset


def _same_steps(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays of one shape step through memory alike: an axis of one element
    has any stride (NumPy keeps the stride its parent had there, e.g. 16 for (3, 1) taken
    every other column of a (3, 2) array, where the span's view has 8)."""
    return all(n <= 1 or s == t for n, s, t in zip(a.shape, a.strides, b.strides, strict=True))


def _span(array: np.ndarray, word: str) -> np.ndarray:
    """The C-ordered span a SLICED view reads (a view of its root's memory): numpy checks
    the span lies inside the root; the view of it must be `array` itself."""
    span = sliced_parts(word)[0]
    item, strides, shape = array.itemsize, array.strides, array.shape
    root = _root(array)
    address = _address(array)
    low = address - _address(root)
    low += sum((n - 1) * s for n, s in zip(shape, strides, strict=True) if s < 0)
    first = low - span_offset(word) * item
    nbytes = math.prod(span) * item
    flat = (root if root.flags.c_contiguous else root.T).reshape(-1).view(np.uint8)
    if first < 0 or first + nbytes > flat.size:
        raise ValueError(f"an array of shape {shape}, strides {strides} is not {word}")
    out = flat[first : first + nbytes].view(array.dtype).reshape(span)
    again = viewed(out, word, shape)
    if not _same_steps(again, array) or _address(again) != address:
        raise ValueError(f"an array of shape {shape}, strides {strides} is not {word}")
    # The span comes from the writeable root: a read-only view keeps its span read-only, or
    # the driver sees another argument type and compiles again inside the call.
    out.flags.writeable = array.flags.writeable
    return out
