"""Scratch a library kernel works in while it runs, planned as a buffer of the plan's scratch
arena: the kernel is passed a slice of the arena (ir/layout.py places it at the kernel's one
step), so it allocates nothing itself, two threads never share it (each call has its own
arena, codegen/run/workspace.py), and the arena's bytes, which explain prints and the checked
mode counts, are the bytes the process holds.

conv2d and its two adjoints run as im2col + GEMM (codegen/kernels/conv.py): each works in a
column matrix of C/groups*kH*kW rows by N*OH*OW positions, one group's product or
output-gradient rows (O/groups by N*OH*OW) and one group's weights (O/groups by
C/groups*kH*kW). At batch 512 of a 12x12 image with 8 channels that is ~6 MB, more than the
plan's own buffers. Allocated by the kernel on every call (np.empty inside compiled code),
glibc served it from its heap from the second call on and kept the freed pages: the bench CNN
held 22-56 MB more than explain printed.

Fused attention (codegen/kernels/attention.py) works per (batch, head) pair and block of ROWS
query rows in a (rows, keys) probability tile, the backward in a second one for dP and dS, and
past KEYS keys in (rows, KEYS) tiles with each row's running statistics (and the forward's
output rows). Allocated per pair on every call, they were 15 allocations a call of a causal
256x32 step, outside the printed peak. A parallel attention kernel runs the pairs on `slots`
threads, each in its own slot of the workspace: the thread count is read when the plan is
lowered (`thread_count`, Numba's, installed by codegen/flags.py) and so fixed for the plan.

>>> from backplan.ir.kernel_workspace import attention_slot_elements, conv_workspace_elements
>>> conv_workspace_elements(batch=2, out_hw=(4, 4), out_channels=8, group_taps=9, groups=1)
616
>>> attention_slot_elements(length=256, keys=256, values=32, grad=True)  # P, dS, the scale
65552
"""

from __future__ import annotations

import math
from typing import NamedTuple

CONV_OPS = ("conv2d", "conv2d_input_grad", "conv2d_weight_grad")
ATTENTION_OPS = ("attention", "attention_grad")
WORKSPACE_OPS = frozenset(CONV_OPS + ATTENTION_OPS)  # the only op kernels given a workspace
ROWS = 128  # query rows per block: a (128, S) f32 tile stays in L2 for S up to ~2k
KEYS = 1024  # keys per tile where a sequence has more: a (128, 1024) f32 tile is 512 KiB
ALIGN = 16  # elements each piece of an attention slot is rounded up to (64 bytes of f32)
PARALLEL_WORK = 1 << 16  # pairs * T * S * D from which attention runs its pairs in parallel


def _one_thread() -> int:
    return 1


thread_count = _one_thread  # threads a parallel library kernel may run on when a plan is lowered


def count_threads_with(counter) -> None:
    """Install the function giving the thread count (codegen/flags.py: Numba's, which
    numba.set_num_threads lowers): ir imports nothing of codegen."""
    global thread_count
    thread_count = counter


class WorkspaceOf(NamedTuple):
    """The memory plan's key for the workspace of `node`'s kernel (the node's own key is its
    output's buffer)."""

    node: object


def workspace_elements(kernel, pinned: dict | None = None, key=None) -> int | None:
    """Elements, of the kernel's dtype, of the workspace `kernel` (an ir.fusion.Kernel) is
    passed; None for a kernel that takes none (its temporaries are the plan's buffers, or a
    few scalars). 0 for an empty batch, which returns before it reads the workspace.
    pinned, key: a symbolic plan's attention slot ceilings, shared by its sizes (one driver
    runs them all, parallel or not as its first size was), and this kernel's key there."""
    if kernel.kind != "op" or kernel.nodes[0].op not in WORKSPACE_OPS:
        return None  # the one list of ops that take one (ir/layout.py asks it of a plan's ops)
    node = kernel.nodes[0]
    if node.op in ATTENTION_OPS:
        return attention_slots(node, pinned, key) * attention_elements(node)
    grad_of_weights = node.op == "conv2d_weight_grad"
    weights = node.type.shape if grad_of_weights else node.inputs[1].type.shape
    gout = node.type.shape if node.op == "conv2d" else node.inputs[int(grad_of_weights)].type.shape
    if 0 in gout:
        return 0
    return conv_workspace_elements(
        batch=gout[0],
        out_hw=(gout[2], gout[3]),
        out_channels=weights[0],
        group_taps=weights[1] * weights[2] * weights[3],
        groups=node.attrs["groups"],
    )


def conv_workspace_elements(batch, out_hw, out_channels, group_taps, groups) -> int:
    """Columns (taps x positions), one group's rows over the positions, one group's weights:
    the three pieces codegen/kernels/conv.py carves its workspace into, in that order."""
    positions = batch * out_hw[0] * out_hw[1]
    group_out = out_channels // groups
    return group_taps * positions + group_out * positions + group_out * group_taps


def attention_dims(node) -> tuple[int, int, int, int, int]:
    """(batch * heads pairs, query length, key length, features, value features) of an
    attention or attention_grad node in either layout ("bthd": (B, T, H, D) arrays)."""
    q, k, v = (x.shape for x in node.inputs[:3])
    if node.attrs.get("layout", "bhtd") == "bthd":
        return q[0] * q[2], q[1], k[1], q[3], v[3]
    return math.prod(q[:-2]), q[-2], k[-2], q[-1], v[-1]


def attention_elements(node) -> int:
    """One slot's elements for this node's kernel (attention_slot_elements)."""
    _, length, keys, _, values = attention_dims(node)
    return attention_slot_elements(length, keys, values, node.op == "attention_grad")


def _piece(elements: int) -> int:
    return -(-elements // ALIGN) * ALIGN


def attention_slot_elements(length: int, keys: int, values: int, grad: bool, tile=KEYS) -> int:
    """Elements one (batch, head) pair works in, as codegen/kernels/attention.py carves them
    in this order, each piece rounded up to ALIGN elements. Up to `tile` keys (KEYS in a
    plan): the (rows, keys) probabilities, in backward also dS and the scale. Past it: a
    (rows, tile) score tile
    (backward: and dP's), the forward's (rows, values) output rows, then the backward's scale
    and each row's max, sum, dot and factor (the forward's max, sum and factor). 0 without
    rows or keys (the kernels return before reading it)."""
    rows = min(ROWS, length)
    if rows == 0 or keys == 0:
        return 0
    if keys <= tile:
        return 2 * _piece(rows * keys) + _piece(2) if grad else _piece(rows * keys)
    if grad:
        return 2 * _piece(rows * tile) + _piece(2) + 4 * _piece(rows)
    return _piece(rows * tile) + _piece(rows * values) + 3 * _piece(rows)


def attention_slots(node, pinned: dict | None = None, key=None) -> int:
    """Slots of an attention kernel's workspace: one per thread running (batch, head) pairs
    at once where the kernel runs them in parallel (more than one pair and thread, and
    PARALLEL_WORK or more), else one. A symbolic plan's sizes keep the first size's ceiling
    (`pinned`); at most one slot a pair."""
    pairs, length, keys, features, _ = attention_dims(node)
    work = pairs * length * keys * max(features, 1)
    ceiling = thread_count() if pairs > 1 and work >= PARALLEL_WORK else 1
    if pinned is not None:
        ceiling = pinned.setdefault(key, ceiling)
    return max(1, min(ceiling, pairs))
