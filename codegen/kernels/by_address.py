"""Library helpers that their callers call by address instead of linking them.

Numba links every function a compiled function calls into the caller's LLVM module, then
optimises the whole module and emits its machine code again: a helper four calls deep was
optimised and emitted five times, once in its own compile and once more in each caller above
it. The attention kernels (a dozen helpers, up to five levels) spent about two thirds of their
cold compile there (11.2 -> 6.6 CPU s for both directions, one core). A helper made with
`by_address` is compiled once per signature and its callers call its native entry point
(codegen/build/native_calls.py: a symbol published in the process, resolved again when a
cached caller loads in another process).

The price is a call LLVM cannot inline (a few nanoseconds): for helpers that run a block of
rows or a GEMM per call, not for a scalar function in an inner loop.

`arrays=(...)` names argument positions whose arrays the helper takes in any layout, and
`read_only=(...)` those it only reads: a caller's C-contiguous workspace and a plan's
read-only strided view then reach the same compiled helper instead of one variant each.
"""

from __future__ import annotations

from numba import types

from backplan.codegen.build.native_calls import NativeCallee
from backplan.codegen.jit import AS_PYTHON, njit


def by_address(arrays: tuple[int, ...] = (), read_only: tuple[int, ...] = (), **options):
    """njit(**options), called by address from compiled callers (plain Python under
    BACKPLAN_KERNELS_AS_PYTHON=1, as njit)."""

    def decorate(fn):
        dispatcher = njit(**options)(fn)
        if AS_PYTHON:
            return dispatcher
        widened = frozenset(arrays) | frozenset(read_only)
        widen = _widening(widened, frozenset(read_only)) if widened else None
        if options.get("no_cpython_wrapper"):
            return CompiledOnly(dispatcher, widen)
        return NativeCallee(dispatcher, widen)

    return decorate


class CompiledOnly(NativeCallee):
    """A helper compiled without a CPython wrapper: compiled code calls it; a call from
    Python raises (Numba would jump into a wrapper that does not exist)."""

    __slots__ = ()

    def __call__(self, *args, **kwargs):
        name = self.dispatcher.py_func.__qualname__
        raise TypeError(f"{name} is called from compiled code only (no_cpython_wrapper)")


def _widening(positions: frozenset, read_only: frozenset):
    """The argument types a call compiles the helper for: arrays at `positions` of any
    layout, read-only at `read_only`; other arguments as the caller's."""

    def widen(args: tuple) -> tuple:
        return tuple(
            _any_layout(t, i in read_only) if i in positions and isinstance(t, types.Array) else t
            for i, t in enumerate(args)
        )

    return widen


def _any_layout(array: types.Array, read_only: bool) -> types.Array:
    return array.copy(layout="A", readonly=read_only or not array.mutable)
