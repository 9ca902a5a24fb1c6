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

>>> from backplan.ir.kernel_workspace import conv_workspace_elements
>>> conv_workspace_elements(batch=2, out_hw=(4, 4), out_channels=8, group_taps=9, groups=1)
616
"""

from __future__ import annotations

from typing import NamedTuple

CONV_OPS = ("conv2d", "conv2d_input_grad", "conv2d_weight_grad")


class WorkspaceOf(NamedTuple):
    """The memory plan's key for the workspace of `node`'s kernel (the node's own key is its
    output's buffer)."""

    node: object


def workspace_elements(kernel) -> int | None:
    """Elements, of the kernel's dtype, of the workspace `kernel` (an ir.fusion.Kernel) is
    passed; None for a kernel that takes none (its temporaries are the plan's buffers, or a
    few scalars). 0 for an empty batch, which returns before it reads the workspace."""
    if kernel.kind != "op" or kernel.nodes[0].op not in CONV_OPS:
        return None
    node = kernel.nodes[0]
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
