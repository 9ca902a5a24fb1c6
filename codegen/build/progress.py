"""Never silent, never chatty: a first call that compiles for more than a couple of seconds is
the process's one line about compiling (codegen/build/compile_notice.py), printed once the
compile has run that long. Under BACKPLAN_VERBOSE=1 a first call predicted to compile that long
says each stage instead: one line when it starts (kernels to compile, already cached, predicted
seconds), one per kernel compiled at most every half second, one when it is done, and the
driver's background build.

BACKPLAN_QUIET=1 turns every line off; BACKPLAN_PROGRESS_SECONDS sets the threshold (default 2).
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

from numba.core import event

from backplan.codegen.build import compile_notice, kernel_cache
from backplan.codegen.render.kernel_source import KernelSource

# Measured on a 2-core Zen 3 box (python -m backplan bench compile; each plan's background
# driver build timed with driver_builder.wait_for_builds): a small serial kernel compiles in
# ~0.2 s, a parallel one in ~0.3-0.5 s. A driver build pays ~2 s of Numba's own helpers
# (reshape checks, error formatting), each kernel's inlined twin again, and ~0.08 s per
# statement: mlp 3.8 s (26 statements, 5 kernels), mlp_deep 18.6 s (206, 5), lstm12 24.4 s
# (270, 21), lstm48 108 s (1098, 21), transformer 28 s (139, 17), cnn 12 s (41, 9). The
# statement cost varies with what the statements call (library functions are linked into the
# driver), so these predict within about 2x, not better.
SERIAL_SECONDS = 0.2
PARALLEL_SECONDS = 0.4
# A first call compiles a kernel's loop taking addresses where it has one, optimised once
# (codegen/build/loop_optimisation.py): measured on a 2-vCPU Intel AVX-512 box, one pinned CPU, an
# unrolled LSTM's 21 kernels 1.5-2.0 s in all, the transformer block's 16 1.9-2.5 s.
ADDRESS_LOOP_SECONDS = 0.12
DRIVER_SECONDS = 2.0
STATEMENT_SECONDS = 0.08
CACHED_SECONDS = 0.005
LINE_INTERVAL = 0.5


@dataclass(frozen=True)
class CompileEstimate:
    """What a first call will compile: distinct loop kernels, how many are already cached,
    and the predicted seconds."""

    kernels: int
    cached: int
    seconds: float
    cached_digests: frozenset = frozenset()  # a prediction: an index on disk may not match

    @property
    def to_compile(self) -> int:
        return self.kernels - self.cached


def estimate(
    kernels: list[KernelSource], driver_cached: bool, driver_statements: int = 0
) -> CompileEstimate:
    """driver_statements: statements of the plan's `run` driver, whose compile grows with them."""
    cached_digests = kernel_cache.cached_digests(kernels)
    cached = [k for k in kernels if k.digest in cached_digests]
    fresh = [k for k in kernels if k.digest not in cached_digests]
    seconds = _first_call_seconds(fresh) + len(cached) * CACHED_SECONDS
    if not driver_cached:
        seconds += driver_seconds(driver_statements, fresh)
    return CompileEstimate(len(kernels), len(cached), seconds, frozenset(cached_digests))


def driver_seconds(statements: int, fresh_kernels: list[KernelSource]) -> float:
    """A driver's compile: Numba's helpers, its statements, and the inlined twin of every
    kernel not compiled before (codegen/render/kernel_source.py)."""
    return DRIVER_SECONDS + statements * STATEMENT_SECONDS + _kernel_seconds(fresh_kernels)


def fresh_twins(kernels: list[KernelSource]) -> list[KernelSource]:
    """The kernels whose form compiled drivers inline is not compiled yet (the folder is
    listed once, however many kernels)."""
    compiled = kernel_cache.cached_digests(kernels, "kernel")
    return [k for k in kernels if k.digest not in compiled]


def _kernel_seconds(kernels: list[KernelSource]) -> float:
    return sum(PARALLEL_SECONDS if k.parallel else SERIAL_SECONDS for k in kernels)


def _first_call_seconds(kernels: list[KernelSource]) -> float:
    return sum(ADDRESS_LOOP_SECONDS if k.takes_addresses else _kernel_seconds([k]) for k in kernels)


threshold_seconds = compile_notice.threshold_seconds
quiet = compile_notice.quiet
verbose = compile_notice.verbose


@contextmanager
def reporting(
    label: str,
    kernels: list[KernelSource],
    driver_cached: bool,
    driver_statements: int = 0,
    driver_parts: tuple = (),
):
    """Around a plan's first call: progress lines on stderr when the compile will be slow.
    driver_parts: the dispatchers of the driver's parts (codegen/render/driver_split.py), each
    compile of which is a line too."""
    guess = estimate(kernels, driver_cached, driver_statements)
    if not verbose() or guess.seconds <= threshold_seconds():
        if guess.to_compile or not driver_cached:
            with compile_notice.compiling(label):
                yield
        else:
            yield
        return
    listener = _Lines(label, guess, {k.digest for k in kernels}, driver_parts)
    with listener.installed():
        yield
    listener.done()


class _Lines:
    def __init__(self, label: str, guess: CompileEstimate, digests: set, parts: tuple = ()):
        self.label, self.guess = label, guess
        self.start = self.last = time.perf_counter()
        self.finished: set[str] = set()  # kernels compiled, in either form (kernel_cache)
        # A kernel predicted cached whose index held other argument types compiles after all:
        # counted as one more to compile, so "n/m" never reads 8/7 and the totals add up.
        self.to_compile, self.cached = guess.to_compile, guess.cached
        self.dispatchers = {
            id(form): digest for digest in digests for form in kernel_cache.compiled_forms(digest)
        }
        self.parts = {id(p): i for i, p in enumerate(parts)}
        _say(
            f"{label}: compiling {guess.to_compile} of {guess.kernels} loop kernels "
            f"({guess.cached} cached), about {guess.seconds:.0f} s"
        )

    @contextmanager
    def installed(self):
        listener = _CompileListener(self)
        with event.install_listener("numba:compile", listener):
            yield

    @property
    def compiled(self) -> int:
        return len(self.finished)

    def kernel_done(self, digest: str) -> None:
        if digest in self.finished:
            return
        self.finished.add(digest)
        if digest in self.guess.cached_digests:
            self.to_compile, self.cached = self.to_compile + 1, self.cached - 1
        now = time.perf_counter()
        if now - self.last >= LINE_INTERVAL:
            self.last = now
            _say(
                f"{self.label}: {self.compiled}/{self.to_compile} kernels compiled, "
                f"{now - self.start:.1f} s"
            )

    def part_done(self, index: int) -> None:
        _say(
            f"{self.label}: driver part {index + 1}/{len(self.parts)} compiled, "
            f"{time.perf_counter() - self.start:.1f} s"
        )

    def done(self) -> None:
        _say(
            f"{self.label}: ready: {self.compiled} kernels compiled, {self.cached} cached, "
            f"{self.guess.kernels} in all, {time.perf_counter() - self.start:.1f} s"
        )


def announce_driver_build(label: str, statements: int, kernels: list[KernelSource]) -> bool:
    """Says, when the driver's compile will be slow, that calls run it as Python meanwhile;
    whether it said so (then its end is a line too)."""
    if not verbose():
        return False
    seconds = driver_seconds(statements, fresh_twins(kernels))
    if seconds <= threshold_seconds():
        return False
    _say(
        f"{label}: calls run the driver as Python (same kernels) while the compiled driver "
        f"({statements} statements, about {seconds:.0f} s) builds in a background process"
    )
    return True


def announce_background_compile(
    label: str, kernels: list[KernelSource], driver_statements: int
) -> bool:
    """BACKPLAN_DRIVER=reference: says, when the compile will be slow, that calls run on the
    reference interpreter until kernels and driver are built."""
    if not verbose():
        return False
    guess = estimate(kernels, False, driver_statements)
    if guess.seconds <= threshold_seconds():
        return False
    _say(
        f"{label}: calls run on the reference interpreter while {guess.to_compile} of "
        f"{guess.kernels} loop kernels and the driver compile in a background process "
        f"(about {guess.seconds:.0f} s)"
    )
    return True


def say(line: str) -> None:
    _say(line)


def _say(line: str) -> None:
    print(f"backplan: {line}", file=sys.stderr, flush=True)


class _CompileListener(event.Listener):
    """Numba announces each compile (not cache loads); the plan's loop kernels are counted and
    each part of its driver is a line."""

    def __init__(self, lines: _Lines):
        self.lines = lines

    def on_start(self, event):
        pass

    def on_end(self, event):
        dispatcher = id(event.data.get("dispatcher"))
        if dispatcher in self.lines.dispatchers:
            self.lines.kernel_done(self.lines.dispatchers[dispatcher])
        elif dispatcher in self.lines.parts:
            self.lines.part_done(self.lines.parts[dispatcher])
