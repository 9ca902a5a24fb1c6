"""The child process that compiles one plan's driver into the disk cache
(codegen/driver_tier.py): it reads the plan's generated source, its loop kernels and the
argument types from its parent on stdin, compiles `run` for them, and exits. The parent then
loads the compiled driver from the cache, where Numba wrote it signed."""

from __future__ import annotations

import json
import os
import sys

from . import cache, kernel_cache
from .driver_tier import numba_signature
from .jit import start_parallel_runtime
from .kernel_source import KernelSource


def build(payload: dict) -> None:
    kernels = [
        KernelSource(k["digest"], k["source"], k["parallel"], tuple(k["arguments"]))
        for k in payload["kernels"]
    ]
    start_parallel_runtime()
    kernel_cache.load(kernels)
    module, _, _ = cache.load_module(payload["source"], payload["parts"])
    module.run.compile(numba_signature(payload["signature"]))


if __name__ == "__main__":
    # The parent keeps running steps meanwhile (its BLAS threads spin-wait on every core and
    # starve when a compiler takes one): the build gets what the steps leave.
    os.nice(10)
    build(json.loads(sys.stdin.buffer.read()))
