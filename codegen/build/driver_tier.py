"""A plan's first calls do not wait for its driver to compile.

The loop kernels a plan calls are shared and cached (codegen/build/kernel_cache.py), but its `run`
driver is new code for every plan, and Numba compiles it in seconds to minutes (an unrolled
LSTM's driver: 20 s for 4 steps). The driver's Python function calls exactly the same compiled
kernels, so until the compiled driver exists it runs as Python (the same kernels: the same
results, with a few microseconds of Python per call) while a separate process compiles it into
the disk cache; the plan then loads it and switches (a process, not a thread: a compile holds the
GIL, and every step's kernel call would wait on it).

BACKPLAN_DRIVER picks: `background` (default: built only where worth_compiling says the
compiled driver would save more than 5% of a step; elsewhere calls keep the Python-run driver),
`inline` (compile in the first call), `reference`
(first calls run on the reference interpreter while the child compiles the kernels too: a first
call that waits for no compiler at all) or `python` (never compile the driver: for debugging).
A function's own `background=` (bp.compile, bp.value_and_grad) overrides it for its plans:
True is `reference`, False is `inline`. The builds themselves run in
codegen/build/driver_builder.py.

BACKPLAN_DRIVER_LOOPS=address makes the compiled driver call the loops its first calls ran by
address instead of inlining them (codegen/build/loop_calls.py): its compile is then only its
own statements.

BACKPLAN_DRIVER_AT_EXIT says what happens to a build still running when the program ends:
`kill` (default: no process outlives the program; the build stops with it, even when the
program is killed) or `finish` (asked for: it goes on in its detached process and caches the
driver, so the next run of a short script starts compiled, and a line at exit says so).
"""

from __future__ import annotations

import os
import types

import numpy as np

MODES = ("background", "inline", "reference", "python")
# Measured pinned to one CPU of a 2-vCPU AMD EPYC (/tmp script in the commit: interleaved calls of
# one plan run both ways): a Python-run driver costs about 3-4 us per statement more than the
# compiled one (mlp_tiny: 0.102 against 0.028 ms a step, 26 statements), while a step's kernels
# take at least its FLOPs at 100 GFLOP/s (this box's BLAS peaks near 90-240). The bench
# transformer ran 230 ms a step on the Python-run driver, 215 ms compiled.
PYTHON_STATEMENT_SECONDS = 4e-6
FLOPS_PER_SECOND = 100e9
WORTH_FRACTION = 0.05  # a compiled driver is built when it would save more of a step than this
# The direct driver (codegen/build/direct_driver.py) is emitted in the second call in a tenth of
# a second, in the process, with no build beside the steps: it is worth more than this share.
# The mlp bench step (784-512-512-10, batch 128, one pinned Zen 5 core) ran 2.07 ms a step with
# its Python-run driver against 1.90 direct and 1.91 compiled (thread CPU, interleaved; the
# compiled driver's 5% rule had skipped it: its GEMMs run at 250 GFLOP/s, not 100).
DIRECT_WORTH_FRACTION = 0.01
AT_EXIT_MODES = ("kill", "finish")
TIERS = ("reference", "python", "direct", "compiled")  # what runs a plan's calls, slowest first


class DriverBuildWarning(UserWarning):
    """A plan's driver could not be compiled in the background: its calls stay correct and run
    the driver as Python."""


def driver_mode(background: bool | None = None) -> str:
    """The mode of a plan whose function asked for `background` (None: BACKPLAN_DRIVER's)."""
    if background is not None:
        return "reference" if background else "inline"
    mode = os.environ.get("BACKPLAN_DRIVER") or "background"
    if mode not in MODES:
        raise ValueError(f"BACKPLAN_DRIVER={mode!r}; use one of {', '.join(MODES)}")
    return mode


def worth_compiling(statements: int, flops: float, fraction: float = WORTH_FRACTION) -> bool:
    """Whether a compiled driver would make a step noticeably faster than running the driver
    as Python (by more than `fraction` of it): a small step (mlp_tiny, an unrolled LSTM) spends
    most of its time in Python between kernels, a big one (a transformer block) almost none,
    and there a background build would only take a core from the steps for seconds to minutes.
    The direct driver, emitted in a tenth of a second, is worth a smaller share.

    >>> worth_compiling(26, 651_264)  # mlp_tiny's training step
    True
    >>> worth_compiling(27, 513_000_000)  # the 784-512-512-10 MLP at batch 128
    False
    >>> worth_compiling(27, 513_000_000, DIRECT_WORTH_FRACTION)  # ... its direct driver
    True
    >>> worth_compiling(27, 20_000_000_000, DIRECT_WORTH_FRACTION)
    False
    """
    saved = statements * PYTHON_STATEMENT_SECONDS
    return saved > fraction * (saved + flops / FLOPS_PER_SECOND)


def at_exit_mode() -> str:
    mode = os.environ.get("BACKPLAN_DRIVER_AT_EXIT") or "kill"
    if mode not in AT_EXIT_MODES:
        raise ValueError(
            f"BACKPLAN_DRIVER_AT_EXIT={mode!r}; use one of {', '.join(AT_EXIT_MODES)} (what a "
            "driver build still running when the program ends does: stop, or finish and cache it)"
        )
    return mode


def python_driver(module: types.ModuleType):
    """`run` of the generated module as a plain Python function whose parts are Python too;
    the kernels, GEMMs and library functions it calls stay compiled (address kernels through
    their C entries: codegen/build/kernel_cache.python_call). Its functions are the module's own
    code
    objects bound to a scope of their own: compiling the source again cost an unrolled 48-step
    LSTM's first call 0.05 s, and the module itself must keep the kernels Numba compiles."""
    from backplan.codegen.run import address_calls

    return address_calls.with_addresses(python_scope(module)["run"])


def python_scope(module: types.ModuleType) -> dict:
    """The scope python_driver's functions run in: the module's names, its `run` and
    `run_part_i` as plain Python functions of this scope, its kernels called as Python."""
    from backplan.codegen.build import kernel_cache, native_calls

    scope = dict(module.__dict__, __name__="backplan_python_driver")
    for name, value in list(scope.items()):
        value = scope[name] = native_calls.unwrapped(value)
        if (name == "run" or name.startswith("run_part")) and hasattr(value, "py_func"):
            function = value.py_func
            scope[name] = types.FunctionType(
                function.__code__, scope, name, function.__defaults__, function.__closure__
            )
        elif name.startswith("k_"):
            scope[name] = kernel_cache.python_call(value)
    return scope


def argument_types(arrays: list) -> list:
    """What the compiled driver is compiled for: each argument's dtype, rank, layout and
    whether it is read-only, as Numba types the argument."""
    import numba

    described = []
    for array in arrays:
        kind = numba.typeof(array)
        described.append([str(array.dtype), kind.ndim, kind.layout, not kind.mutable])
    return described


def numba_signature(described: list) -> tuple:
    import numba

    return tuple(
        numba.types.Array(numba.from_dtype(np.dtype(d)), ndim, layout, readonly=readonly)
        for d, ndim, layout, readonly in described
    )
