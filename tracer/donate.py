"""Donated arguments of a compiled call (`bp.compile(fn, donate_argnums=...)`): which buffers
the plan may overwrite this call, and marking the donated tensors unusable afterwards."""

from __future__ import annotations

import sys
import threading

import numpy as np
from numpy.lib.array_utils import byte_bounds

from .errors import TracingError


def donatable(tensors: list, donated: tuple[int, ...], unread=frozenset()) -> frozenset[int]:
    """The donated inputs whose memory nothing else can see: an array NumPy allocated, held only
    by its tensor (no view from .numpy(), no tensor sharing it through detach(), no producer
    behind bp.from_dlpack), overlapping the memory of no other argument (two tensors over one
    array, or a view of it, are never donated). Decided by memory, not by object identity.
    Others still compute correctly; their outputs just get new buffers.

    One exception (`unread`: the input positions the plans never read): donated tensors over
    one array, all but one unread, as a step returning one value as two outputs passes them
    back (`return {"a": y, "b": y}`): the one read is donated (the first, when none is), since
    no read of the others can see it overwritten and the call gives them all up."""
    if not unread:
        owners = _owning_arrays_held_once(tensors, donated)
        if owners is not None:
            return owners
    return donatable_by_memory(tensors, donated, unread)


def donatable_by_memory(tensors: list, donated, unread=frozenset()) -> frozenset[int]:
    """donatable's answer from every argument's memory: owners grouped, shared byte ranges
    compared, each donated array's holders counted."""
    arrays = [t._data for t in tensors]
    extra = {}  # position -> the other donated tensors holding its very array
    if unread:
        arrays, extra = _one_owner_per_shared_array(tensors, donated, unread)
    shared = _overlapping(arrays)
    shared.update(i for i, array in enumerate(arrays) if array is None)
    del arrays  # its references would count as holders below
    return frozenset(
        i for i in donated if i not in shared and _held_only_by_tensor(tensors[i], extra.get(i, 0))
    )


def _owning_arrays_held_once(tensors: list, donated) -> frozenset[int] | None:
    """donatable's answer, without comparing memory, when every donated tensor's array is held
    by its tensor alone and owns its memory, or is the one view of an array owning it (a
    training loop's donated parameters and state: the last call's outputs, a 0-d one a view of
    its buffer): no other view (a view holds its base), tensor or argument is over that memory,
    so nothing can overlap it. None when some donated array is held elsewhere, over memory
    NumPy does not own, or one tensor is passed twice: the full check decides."""
    seen = set()
    for i in donated:
        data = tensors[i]._data
        # references: the tensor's slot, this local and getrefcount's own argument
        if data is None or sys.getrefcount(data) > 3:
            return None
        owner = data.base  # references: the view's base, this local and the argument
        if owner is None:
            if not data.flags.owndata:  # memory someone outside NumPy owns
                return None
        elif type(owner) is not np.ndarray or sys.getrefcount(owner) > 3:
            return None
        elif not owner.flags.owndata:
            return None
        seen.add(id(data))
    found = 0  # one tensor passed twice (donated or not) is one memory in two places
    for tensor in tensors:
        if id(tensor._data) in seen:
            found += 1
    return frozenset(donated) if found == len(donated) == len(seen) else None


def _one_owner_per_shared_array(tensors: list, donated, unread) -> tuple[list, dict]:
    """(arrays with each group's other members left out, {owner: other members}) for the
    groups of donated tensors holding one array object, all but at most one unread."""
    groups: dict[int, list[int]] = {}
    for i in donated:
        data = tensors[i]._data
        if data is not None:
            groups.setdefault(id(data), []).append(i)
    arrays, extra = [t._data for t in tensors], {}
    for members in groups.values():
        read = [i for i in members if i not in unread]
        if len(members) < 2 or len(read) > 1:
            continue
        owner = read[0] if read else members[0]
        for i in members:
            if i != owner:
                arrays[i] = None
        extra[owner] = len(members) - 1
    return arrays, extra


def _held_only_by_tensor(tensor, others: int = 0) -> bool:
    # references: the tensor's slot and getrefcount's own argument (and `others` tensors more)
    data = tensor._data
    if sys.getrefcount(data) > 3 + others:  # + the local
        return False
    base = data.base
    if base is None:
        return data.flags.owndata
    # NumPy points a view at the array owning the memory; any other base (a DLPack capsule, a
    # buffer, a memory map) means someone outside backplan owns it
    if not isinstance(base, np.ndarray) or not base.flags.owndata:
        return False
    return sys.getrefcount(base) <= 3  # + the view's base and the local


def _overlapping(arrays: list) -> set[int]:
    """Positions of the arrays whose byte ranges overlap another's (np.may_share_memory for
    every pair). Arrays over different owning arrays cannot overlap (each owner allocated its
    own memory), so only arrays sharing an owner have their byte ranges compared: reading an
    address costs ~2 us an array, most of a small training step's donation checks. Where any
    array's memory belongs to something else (a DLPack capsule, a buffer, a memory map) every
    range is compared."""
    owners: dict[int, list[int]] = {}
    for i, array in enumerate(arrays):
        if array is None or not array.size:
            continue
        owner = array if array.base is None else array.base
        if type(owner) is not np.ndarray or not owner.flags.owndata:
            return _overlapping_ranges(arrays)
        owners.setdefault(id(owner), []).append(i)
    shared: set[int] = set()
    for members in owners.values():
        if len(members) > 1:
            shared.update(_overlapping_ranges([arrays[i] for i in members], members))
    return shared


def _overlapping_ranges(arrays: list, positions=None) -> set[int]:
    """Positions (positions[k] for arrays[k]) of the arrays whose byte ranges overlap another's,
    in one sort instead of n^2 comparisons."""
    spans = sorted((*byte_bounds(a), i) for i, a in enumerate(arrays) if a is not None and a.size)
    shared: set[int] = set()
    reach, holder = -1, -1  # the furthest end so far and whose it is
    for start, end, i in spans:
        if start < reach:
            shared.update((i, holder))
        if end > reach:
            reach, holder = end, i
    return shared if positions is None else {positions[i] for i in shared}


_claiming = threading.Lock()


def mark_donated(tensors: list, traced, loc: str) -> None:
    """Give the donated tensors to this call before it runs, atomically: the same tensor passed
    by another thread at the same time then raises DonatedError, instead of both calls writing
    their results into its one buffer (each having checked it was live before either marked it)."""
    where = f"{traced.donated_to} at {loc}"
    with _claiming:
        for i in traced.donated:
            if tensors[i]._donated is not None:  # _check_live raises; the call costs ~0.1 us
                tensors[i]._check_live()
        for i in traced.donated:
            tensors[i]._donated = where


def release_donated(tensors: list, traced) -> None:
    """After the call: each donated tensor lets go of its buffer (a stand-in of its shape and
    dtype holding no memory is left for its repr and DonatedError). The call's outputs may live
    in that buffer now; a donated tensor the caller still names (`initial = params` before
    the loop) kept it referenced, so the next call saw it shared and could not write in place."""
    for i in traced.donated:
        data = tensors[i]._data
        if data is not None:
            tensors[i]._data = stand_in(data)


_ZEROS = bytes(64)  # read-only: every stand-in reads its one zero element from here
_stand_ins: dict = {}  # (shape, dtype) -> the stand-in: read-only and memoryless, so shared
MAX_STAND_INS = 1024


def stand_in(array: np.ndarray) -> np.ndarray:
    """A read-only array of array's shape and dtype holding no memory of its own (every element
    the same zero), one per shape and dtype: nothing can write it, so donated tensors share it.
    A lookup costs ~0.1 us, the ndarray constructor ~0.4 us and np.broadcast_to ~3 us: a step
    donating a model's parameters and optimizer state needs dozens each call."""
    key = (array.shape, array.dtype)
    kept = _stand_ins.get(key)
    if kept is None:
        kept = _new_stand_in(*key)
        if len(_stand_ins) >= MAX_STAND_INS:  # a dynamic axis: one per size seen
            _stand_ins.clear()
        _stand_ins[key] = kept
    return kept


def _new_stand_in(shape: tuple, dtype: np.dtype) -> np.ndarray:
    if dtype.itemsize > len(_ZEROS) or dtype.hasobject:
        return np.broadcast_to(np.zeros((), dtype), shape)
    return np.ndarray(shape, dtype, _ZEROS, 0, (0,) * len(shape))


def unmark_donated(tensors: list, traced) -> None:
    """A call that raised gives its donated tensors back (as before it ran)."""
    for i in traced.donated:
        tensors[i]._donated = None


def check_donated_inputs(names: list[str], donated: tuple[int, ...], wrt: list[bool]) -> None:
    """A donated input that requires grad would be overwritten while backward still needs it."""
    for i in donated:
        if wrt[i]:
            raise TracingError(
                f"argument {names[i]} is donated (donate_argnums) but requires grad: backward "
                "may read its buffer after the call has overwritten it. Compute gradients "
                "inside the step with bp.value_and_grad (parameters need no requires_grad), or "
                "leave this argument out of donate_argnums."
            )
