"""DLPack exchange, zero-copy both ways on the CPU: `torch.from_dlpack(t)`, `np.from_dlpack(t)`
and `bp.from_dlpack(x)` share memory instead of copying.

A tensor exports its read-only buffer flagged read-only (DLPack 1.0); a consumer that only
speaks the older protocol, which cannot say read-only, gets a copy, so it can never write into
an immutable tensor. Importing shares the producer's memory: backplan never writes to it, but
if the producer changes it afterwards the tensor sees the change; `bp.tensor(x)` copies."""

from __future__ import annotations

from typing import Any

import numpy as np

from backplan.ir.types import dtype_name

from .tensor import Tensor

CPU_DEVICE = 1  # DLPack's kDLCPU


def tensor_dlpack(self, *, stream=None, max_version=None, dl_device=None, copy=None):
    data = self._concrete("__dlpack__()")
    if max_version is None or max_version[0] < 1:
        if copy is False:
            raise BufferError(
                "a backplan tensor is read-only, which DLPack before 1.0 cannot signal; "
                "ask for max_version=(1, 0) or allow a copy"
            )
        return data.copy().__dlpack__(stream=stream)
    return data.__dlpack__(stream=stream, max_version=max_version, dl_device=dl_device, copy=copy)


def tensor_dlpack_device(self) -> tuple[int, int]:
    return (CPU_DEVICE, 0)


def from_dlpack(x: Any) -> Tensor:
    """A tensor sharing memory with x, any object with `__dlpack__` (a NumPy array, a CPU torch
    tensor, a JAX array). Only CPU memory and backplan's dtypes (bool, uint8, int32, int64,
    float32, float64) are accepted; anything else raises with the conversion to make.

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
    array = np.from_dlpack(x)
    dtype_name(array.dtype)  # DtypeError for float16, complex, ...
    view = array.view()
    view.flags.writeable = False
    tensor = Tensor.__new__(Tensor)
    tensor._init(view, None, None)
    return tensor


def install(tensor_cls) -> None:
    tensor_cls.__dlpack__ = tensor_dlpack
    tensor_cls.__dlpack_device__ = tensor_dlpack_device
