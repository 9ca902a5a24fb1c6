"""Bytes a kernel allocates inside itself while it runs and frees before it returns: no buffer
of the plan (no arena slot, no output), so the memory layout does not hold them, but the
process does while the kernel runs, on top of everything the plan holds then.

conv2d and its two adjoints run as im2col + GEMM (codegen/kernels/conv.py): each allocates a
column matrix of C/groups*kH*kW rows by N*OH*OW positions, one group's product or
output-gradient rows (O/groups by N*OH*OW) and one group's weights (O/groups by
C/groups*kH*kW). At batch 512 of a 12x12 image with 8 channels that is ~6 MB, more than the
plan's own buffers; leaving it out made explain's peak 6.6 MB short of the process's.

>>> from backplan.ir.kernel_workspace import conv_workspace_elements
>>> conv_workspace_elements(batch=2, out_hw=(4, 4), out_channels=8, group_taps=9, groups=1)
616
"""

from __future__ import annotations

from .types import DTYPES

CONV_OPS = ("conv2d", "conv2d_input_grad", "conv2d_weight_grad")


def workspace_bytes(kernel) -> int:
    """What `kernel` (an ir.fusion.Kernel, or None) allocates while it runs; 0 for kernels
    whose temporaries live in the plan's arena or are a few scalars."""
    if kernel is None or kernel.kind != "op" or kernel.nodes[0].op not in CONV_OPS:
        return 0
    node = kernel.nodes[0]
    weights = node.type.shape if node.op == "conv2d_weight_grad" else node.inputs[1].type.shape
    gout = node.inputs[1 if node.op == "conv2d_weight_grad" else 0].type.shape
    if node.op == "conv2d":
        gout = node.type.shape
    if 0 in gout:
        return 0  # an empty batch returns before allocating
    elements = conv_workspace_elements(
        batch=gout[0],
        out_hw=(gout[2], gout[3]),
        out_channels=weights[0],
        group_taps=weights[1] * weights[2] * weights[3],
        groups=node.attrs["groups"],
    )
    return elements * DTYPES[node.inputs[0].type.dtype].itemsize


def conv_workspace_elements(batch, out_hw, out_channels, group_taps, groups) -> int:
    """Columns (taps x positions), one group's rows over the positions, one group's weights."""
    positions = batch * out_hw[0] * out_hw[1]
    group_out = out_channels // groups
    return group_taps * positions + group_out * positions + group_out * group_taps
