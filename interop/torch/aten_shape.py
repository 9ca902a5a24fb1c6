"""The view family of core ATen (view, permute, expand, slice, select, cat, split, ...) as
backplan's shape ops. backplan tensors are immutable, so a view and a copy are the same
value: clone and the aliasing ops pass their input through."""

from __future__ import annotations

import sys

from backplan.tracer import ops
from backplan.tracer.conv import arange

from .dtypes import to_dtype
from .table import aten


@aten("view.default", "_unsafe_view.default", "reshape.default")
def view(x, size):
    return ops.reshape(x, tuple(size))


@aten("clone.default", "alias.default", "contiguous.default", "lift_fresh_copy.default")
def identity(x, **_memory_format):
    return x


@aten("_to_copy.default")
def to_copy(x, dtype=None, **_placement):
    return x if dtype is None else ops.astype(x, to_dtype(dtype))


@aten("permute.default")
def permute(x, dims):
    return ops.permute(x, tuple(d % max(x.ndim, 1) for d in dims))


@aten("transpose.int")
def transpose(x, dim0, dim1):
    return ops.swapaxes(x, dim0, dim1)


@aten("t.default")
def t(x):
    return x if x.ndim < 2 else ops.swapaxes(x, 0, 1)


@aten("expand.default")
def expand(x, size, implicit=False):
    lead = len(size) - x.ndim
    shape = tuple(x.shape[i - lead] if d == -1 else d for i, d in enumerate(size))
    return ops.broadcast_to(x, shape)


@aten("repeat.default")
def repeat(x, repeats):
    """torch's Tensor.repeat (np.tile): each axis of size d read r times, as a broadcast over
    a new axis before it and a reshape (repeats may add leading axes)."""
    shape = (1,) * (len(repeats) - x.ndim) + tuple(x.shape)
    spread = tuple(d for pair in zip([1] * len(shape), shape, strict=True) for d in pair)
    tiled = tuple(d for pair in zip(repeats, shape, strict=True) for d in pair)
    x = ops.broadcast_to(ops.reshape(x, spread), tiled)
    return ops.reshape(x, tuple(r * d for r, d in zip(repeats, shape, strict=True)))


@aten("unsqueeze.default")
def unsqueeze(x, dim):
    return ops.expand_dims(x, dim)


@aten("squeeze.dims", "squeeze.dim", "squeeze.default")
def squeeze(x, dim=None):
    if dim is None:
        return ops.squeeze(x)
    dims = [dim] if isinstance(dim, int) else list(dim)
    kept = [d % max(x.ndim, 1) for d in dims if x.shape[d] == 1]  # ATen skips size > 1
    return ops.squeeze(x, tuple(kept)) if kept else x


@aten("slice.Tensor")
def slice_(x, dim=0, start=None, end=None, step=1):
    end = None if end is not None and end >= sys.maxsize // 2 else end
    index = [slice(None)] * x.ndim
    index[dim] = slice(start, end, step)
    return x[tuple(index)]


@aten("flip.default")
def flip(x, dims):
    """torch.flip: a slice with step -1 on each axis named (no copy in the graph)."""
    index = [slice(None)] * x.ndim
    for d in dims:
        index[d % max(x.ndim, 1)] = slice(None, None, -1)
    return x[tuple(index)]


@aten("select.int")
def select(x, dim, index):
    where = [slice(None)] * x.ndim
    where[dim] = index
    return x[tuple(where)]


@aten("cat.default")
def cat(tensors, dim=0):
    return ops.concatenate([t for t in tensors if t.shape != (0,)], dim)


@aten("stack.default")
def stack(tensors, dim=0):
    return ops.stack(tensors, dim)


@aten("split_with_sizes.default")
def split_with_sizes(x, sizes, dim=0):
    parts, start = [], 0
    for size in sizes:
        parts.append(slice_(x, dim, start, start + size))
        start += size
    return tuple(parts)


@aten("split.Tensor")
def split(x, split_size, dim=0):
    length = x.shape[dim]
    sizes = [min(split_size, length - s) for s in range(0, length, split_size)]
    return split_with_sizes(x, sizes, dim)


@aten("flatten.using_ints")
def flatten(x, start_dim=0, end_dim=-1):
    start, end = start_dim % max(x.ndim, 1), end_dim % max(x.ndim, 1)
    middle = 1
    for d in x.shape[start : end + 1]:
        middle *= d
    return ops.reshape(x, x.shape[:start] + (middle,) + x.shape[end + 1 :])


@aten("index.Tensor")
def index(x, indices):
    return x[tuple(slice(None) if i is None else i for i in indices)]


@aten("index_select.default")
def index_select(x, dim, indices):
    return ops.take(x, indices, axis=dim)


@aten("gather.default")
def gather(x, dim, index, sparse_grad=False):
    """out[..., i, ...] = x[..., index[..., i, ...], ...] along dim: integer-array indexing
    with an arange on every other axis (cross_entropy and nll_loss decompose to it)."""
    dim %= max(x.ndim, 1)
    keys = []
    for axis, size in enumerate(index.shape):
        if axis == dim:
            keys.append(index)
        else:
            shape = [1] * index.ndim
            shape[axis] = size
            keys.append(ops.reshape(arange(0, size), tuple(shape)))
    return x[tuple(keys)]


@aten("_assert_tensor_metadata.default")
def assert_metadata(x, *args, **kwargs):
    """A dtype/device check torch.export leaves in the graph: shapes and dtypes are checked when
    the function is called, so nothing to compute."""
    return None
