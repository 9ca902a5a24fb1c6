"""One fused loop as a kernel function of its own, in a canonical form, so that every plan with
the same loop body (any value names, any sizes) shares one compiled kernel.

The loop lines name arrays after IR values (v12, v12_k), locals t12, accumulators acc_v12,
partial rows part_v12 and sizes n0 or s1_n0. Here every such name is renumbered by first
appearance, array and size names become the kernel's parameters in that order, and the source
is keyed by its hash. Dtype and layout are left to Numba's dispatch: one compiled version per
argument types, all behind the same cached dispatcher.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

KERNEL_HEADER = '''"""A backplan loop kernel, shared by every plan whose loop has this body.
Keyed by the hash of this source; regenerated and compared before it runs; do not edit."""
import math

import numpy as np
from backplan.codegen.jit import njit, prange

from backplan.codegen.flags import JIT_OPTIONS
from backplan.codegen.scalar_functions import *  # noqa: F403
'''

# (pattern, canonical prefix): arrays and sizes are parameters; the rest are locals.
_NAMES = re.compile(
    r"\b(?:(?P<acc>acc_v\d+)|(?P<part>part_v\d+)|(?P<array>v\d+(?:_k\d*|_flat)?)"
    r"|(?P<local>t\d+)|(?P<size>(?:s\d+_)?n\d+))\b"
)
_PREFIX = {"acc": "acc", "part": "part", "array": "a", "local": "t", "size": "n"}


@dataclass(frozen=True)
class KernelSource:
    """A canonical kernel and how one plan calls it."""

    digest: str  # hash of `source`: the kernel's identity, file name and registry key
    source: str  # a whole module defining `kernel`
    parallel: bool
    arguments: tuple[str, ...]  # the plan's expressions for the parameters, in order

    @property
    def name(self) -> str:
        """The name the plan's driver gives the kernel."""
        return f"k_{self.digest[:20]}"


def canonical_kernel(lines: list[str], sizes: dict[str, int], parallel: bool, salt: str):
    """lines: the loop's source (sizes as names from `sizes`). salt: everything else the
    compiled code depends on (code generator fingerprint, flags)."""
    renamed, params, arguments = {}, [], []
    counters = dict.fromkeys(_PREFIX, 0)

    def rename(match: re.Match) -> str:
        word = match.group(0)
        if word not in renamed:
            kind = match.lastgroup
            renamed[word] = f"{_PREFIX[kind]}{counters[kind]}"
            counters[kind] += 1
            if kind in ("array", "size"):
                params.append(renamed[word])
                arguments.append(f"np.intp({sizes[word]})" if kind == "size" else word)
        return renamed[word]

    body = [_NAMES.sub(rename, line) for line in lines]
    decorator = "@njit(parallel=True, **JIT_OPTIONS)" if parallel else "@njit(**JIT_OPTIONS)"
    source = "\n".join(
        [KERNEL_HEADER, "", decorator, f"def kernel({', '.join(params)}):"]
        + ["    " + line for line in body]
    )
    source += "\n"
    digest = hashlib.sha256((salt + "\n" + source).encode()).hexdigest()
    return KernelSource(digest, source, parallel, tuple(arguments))
