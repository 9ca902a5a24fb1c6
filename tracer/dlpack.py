"""DLPack exchange, zero-copy both ways on the CPU: `torch.from_dlpack(t)`, `np.from_dlpack(t)`
and `bp.from_dlpack(x)` share memory instead of copying.

A tensor exports its read-only buffer flagged read-only (DLPack 1.0); a consumer that only
speaks the older protocol, which cannot say read-only, gets a copy, so it can never write into
an immutable tensor. Importing shares the producer's memory: backplan never writes to it, but
if the producer changes it afterwards the tensor sees the change; `bp.tensor(x)` copies.

bfloat16 crosses too (torch.bfloat16, jnp.bfloat16), still without copying, though NumPy's DLPack
knows no bfloat16: a bfloat16 tensor is exported as NumPy's uint16 capsule of the same bytes
relabelled kDLBfloat, and an imported kDLBfloat capsule is relabelled uint16 for NumPy to read,
then viewed as ml_dtypes.bfloat16 (`_relabel`). float16 is NumPy's own."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from backplan.ir.types import DTYPES, dtype_name

from .tensor import Tensor

CPU_DEVICE = 1  # DLPack's kDLCPU
UINT16 = (1, 16)  # DLDataType (code, bits): kDLUInt
BFLOAT16 = (4, 16)  # kDLBfloat
# where the DLDataType of the DLTensor sits in each capsule's struct (dlpack.h): DLTensor is
# first in DLManagedTensor; DLManagedTensorVersioned puts version, manager_ctx, deleter and
# flags (32 bytes) before it. In DLTensor: data (8), device (8), ndim (4), then dtype.
DTYPE_OFFSET = {b"dltensor": 20, b"dltensor_versioned": 32 + 20}
_capsule_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_name.restype, _capsule_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _relabel(capsule, old: tuple[int, int], new: tuple[int, int]) -> bool:
    """Rewrite the element type of an unconsumed DLPack capsule from old to new (code, bits,
    one lane), in place; False (nothing changed) if its type is not old."""
    name = _capsule_name(capsule)
    if name not in DTYPE_OFFSET:
        return False
    field = (ctypes.c_uint8 * 4).from_address(_capsule_pointer(capsule, name) + DTYPE_OFFSET[name])
    lanes = field[2] | field[3] << 8
    if (field[0], field[1], lanes) != (*old, 1):
        return False
    field[0], field[1] = new
    return True


class _BfloatAsUint16:
    """x's DLPack export with a bfloat16 payload labelled uint16, for np.from_dlpack."""

    def __init__(self, x):
        self.x, self.was_bfloat16 = x, False

    def __dlpack__(self, **options):
        capsule = self.x.__dlpack__(**options)
        self.was_bfloat16 = _relabel(capsule, BFLOAT16, UINT16)
        return capsule

    def __dlpack_device__(self):
        return self.x.__dlpack_device__()


def tensor_dlpack(self, *, stream=None, max_version=None, dl_device=None, copy=None):
    data = self._concrete("__dlpack__()")
    bfloat16 = data.dtype == DTYPES.get("bf16")
    if bfloat16:
        data = data.view(np.uint16)
    if max_version is None or max_version[0] < 1:
        if copy is False:
            raise BufferError(
                "a backplan tensor is read-only, which DLPack before 1.0 cannot signal; "
                "ask for max_version=(1, 0) or allow a copy"
            )
        capsule = data.copy().__dlpack__(stream=stream)
    else:
        capsule = data.__dlpack__(
            stream=stream, max_version=max_version, dl_device=dl_device, copy=copy
        )
    if bfloat16 and not _relabel(capsule, UINT16, BFLOAT16):
        raise BufferError("bfloat16 over DLPack: NumPy's capsule was not the expected uint16")
    return capsule


def tensor_dlpack_device(self) -> tuple[int, int]:
    return (CPU_DEVICE, 0)


def from_dlpack(x: Any) -> Tensor:
    """A tensor sharing memory with x, any object with `__dlpack__` (a NumPy array, a CPU torch
    tensor, a JAX array). Only CPU memory and backplan's dtypes (bool, uint8, int32, int64,
    bfloat16, float16, float32, float64) are accepted; anything else raises with the
    conversion to make.

    >>> import numpy as np, backplan as bp
    >>> a = np.arange(3.0, dtype=np.float32)
    >>> t = bp.from_dlpack(a)
    >>> np.shares_memory(t.numpy(), a)
    True
    """
    device = x.__dlpack_device__() if hasattr(x, "__dlpack_device__") else None
    if device is not None and int(device[0]) != CPU_DEVICE:
        raise TypeError(
            f"bp.from_dlpack: the array lives on DLPack device {tuple(device)}, but backplan "
            "runs on the CPU; move it first (x.cpu() in PyTorch, jax.device_get(x) in JAX)"
        )
    source = _BfloatAsUint16(x) if hasattr(x, "__dlpack__") else x
    array = np.from_dlpack(source)
    if isinstance(source, _BfloatAsUint16) and source.was_bfloat16:
        array = array.view(DTYPES["bf16"])
    dtype_name(array.dtype)  # DtypeError for float16, complex, ...
    view = array.view()
    view.flags.writeable = False
    tensor = Tensor.__new__(Tensor)
    tensor._init(view, None, None)
    return tensor
