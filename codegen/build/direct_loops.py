"""Loops with an axis of a few elements, compiled for the direct driver with their sizes as
constants and linked into its module.

The direct driver (codegen/build/direct_driver.py) calls each loop's own compiled entry, which
takes its sizes as arguments: a loop over windows of two (a 2x2 max pool's forward, the
counts and the masked gradient of its backward) runs its innermost axes as loops of two
iterations LLVM can neither unroll nor vectorise. The linked driver (its loops inlined with the
sizes as constants) ran such a CNN's pooling in 67 us against 118 us called by address, and
its step 1.04-1.17x faster (BENCHMARKS.md, 31). Here a call worth it (`worth_specialising`:
an innermost axis of at most TINY_AXIS elements in a loop over at least SMALL_LOOP_ELEMENTS)
gets its own copy of the loop: its source with the sizes assigned at its top, compiled once
(Numba's full level-3 pipeline unrolls and vectorises it as in the linked driver); the driver
links that code into its module, so its cached object file holds it and a later process loads
it as it is. The price is one small compile per such call in the build (the direct driver's
build for cnn 0.18 -> 0.71 CPU s); loops of longer innermost axes, which gain little from
constant sizes, are still called by address.
"""

from __future__ import annotations

import math
import threading

from backplan.codegen.flags import SMALL_LOOP_ELEMENTS

TINY_AXIS = 4  # an axis this short runs as a loop LLVM cannot vectorise unless it is constant
_compiled: dict = {}  # (loop, sizes) -> Numba's compiled specialisation, once per process
_lock = threading.Lock()


def worth_specialising(sizes: list[int]) -> bool:
    """Whether a loop call over these sizes (its size parameters in order: outer loops first)
    gains from constant sizes: an innermost axis of a few elements, in a loop over enough
    elements that its time shows in a step.

    >>> worth_specialising([2048, 2, 4, 2])  # a 2x2 max pool over 32 x 16 x 8 x 8
    True
    >>> worth_specialising([32, 4, 64])  # a bias and ReLU over 4 channels: inner axis long
    False
    >>> worth_specialising([8, 2])  # too few elements to show in a step
    False
    """
    return bool(sizes) and sizes[-1] <= TINY_AXIS and math.prod(sizes) >= SMALL_LOOP_ELEMENTS


def strides_lines(sizes: list[int]) -> bool:
    """Whether the outermost loop steps over 16 elements or more (a 64-byte line of float32):
    LLVM's loop vectoriser would vectorise it with gathers, a lane a line apart, slower than
    its unrolled scalar and SLP code (a 2x2 max pool over 8 x 8 images: 9 against 17 us; over
    4 x 4, 8 elements a step, vectorised 3.7 against 4.7 us)."""
    return math.prod(sizes[1:]) >= 16


def _options(unrolled: bool) -> dict:
    """Numba's options for a loop at constant sizes: no wrapper, no disk cache (made from a
    string: the driver's object file keeps it); Numba's full level-3 pipeline, or the
    unrolled one without the loop vectoriser."""
    from backplan.codegen.build.loop_optimisation import UnrolledLoopCompiler
    from backplan.codegen.flags import LEAN_KERNEL_JIT_OPTIONS

    options = {**LEAN_KERNEL_JIT_OPTIONS, "no_cpython_wrapper": True, "cache": False}
    if unrolled:
        options["pipeline_class"] = UnrolledLoopCompiler
    return options


def specialised(call, sizes: dict[int, int], unrolled: bool | None = None):
    """Numba's compiled version of the loop `call` (an AddressCall) with the parameters at the
    positions of `sizes` bound to those values: the loop's own source with those parameters
    assigned at its top (one compile; the parameters stay, unused, so the driver passes the
    same arguments); None where the loop's source cannot be read. unrolled: compiled without
    the loop vectoriser (default: `strides_lines` of `sizes`, which must then be all of the
    loop's sizes; a driver binding only some of them decides from all)."""
    import inspect

    from numba import njit

    from backplan.codegen.build import loop_batch

    loop = call.loop(False)
    if unrolled is None:
        unrolled = strides_lines(list(sizes.values()))
    key = (loop, tuple(sorted(sizes.items())), unrolled)
    with _lock:
        if key in _compiled:
            return _compiled[key]
        function = loop.py_func
        names = function.__code__.co_varnames[: function.__code__.co_argcount]
        try:
            lines = inspect.getsource(function).splitlines()
        except (OSError, TypeError):  # no source file beside it: called by address instead
            return None
        head = next(i for i, line in enumerate(lines) if line.startswith("def "))
        bound = [f"    {names[i]} = {int(value)}" for i, value in sorted(sizes.items())]
        source = "\n".join([lines[head], *bound, *lines[head + 1 :]]) + "\n"
        scope = dict(function.__globals__)
        exec(compile(source, f"<{function.__module__} at constant sizes>", "exec"), scope)
        compiled = njit(**_options(unrolled))(scope[function.__name__])
        signature = loop_batch.signature(loop)
        compiled.compile(signature)
        _compiled[key] = compiled.overloads[signature]
        return _compiled[key]
