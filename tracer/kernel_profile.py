"""fn.profile(*args): the measured seconds of each kernel one call of a compiled function runs,
in the order explain lists them (report.peak.steps), for report.save_trace(times=...).

The call runs `warmup` times as usual (compiling, settling each plan's driver), once more to
make each plan's timed driver, then `repeat`
times with each compiled plan's kernels timed (runtime/kernel_times.py) and `repeat` times
untimed; each kernel's time is its median over the timed calls. A timed call runs the plan's
driver as Python calling the same compiled kernels, so a kernel's seconds include the few
microseconds of Python before it; within each timed call the kernels' sum is at most that call's
wall time (`kernel_shares`: the medians' sum against the median call need not be);
`call_seconds` is the untimed call's, for comparison. A compiled
function returning a scalar loss that requires grad is called with its backward(), the step
explain counts (the arguments' .grad are put back as they were after each call)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

from backplan.runtime.kernel_times import measuring

from .pytree import flatten, tree_map
from .tensor import Tensor


@dataclass(frozen=True)
class KernelProfile:
    """Per kernel (plan name, median seconds), in run order; the calls' median wall times."""

    kernels: tuple[tuple[str, float], ...]
    call_seconds: float  # a call as it runs untimed
    timed_call_seconds: float  # the median call with its kernels timed
    kernel_shares: tuple[float, ...] = ()  # per timed call: its kernels' seconds / its wall time

    @property
    def seconds(self) -> list[float]:
        """Each kernel's median seconds, in order: report.save_trace(path, times=...)."""
        return [s for _, s in self.kernels]

    def __str__(self) -> str:
        total = sum(self.seconds)
        lines = [
            f"{len(self.kernels)} kernels, {total * 1e6:.1f} us in all; a call "
            f"{self.call_seconds * 1e6:.1f} us (timed: {self.timed_call_seconds * 1e6:.1f} us)"
        ]
        lines += [f"{s * 1e6:10.1f} us  {plan}" for plan, s in self.kernels]
        return "\n".join(lines)


def profile(fn, args: tuple, kwargs: dict, repeat: int, warmup: int) -> KernelProfile:
    """See the module docstring. Donated arguments are copied for each call."""
    if not isinstance(repeat, int) or isinstance(repeat, bool) or repeat < 1:
        raise ValueError(
            f"profile: repeat is the number of timed calls (an int >= 1), got {repeat!r}"
        )
    donated = set(getattr(getattr(fn, "arguments", None), "donate_nums", ()) or ())

    leaves = [t for t in flatten((args, kwargs))[0] if isinstance(t, Tensor) and t.requires_grad]

    def call():
        fresh = tuple(_copied(a) if i in donated else a for i, a in enumerate(args))
        grads = [t.grad for t in leaves]
        start = time.perf_counter()
        out = fn(*fresh, **kwargs)
        if isinstance(out, Tensor) and out.grad_fn is not None and out.shape == ():
            out.backward()  # a compiled loss: the step explain counts is call + backward()
        seconds = time.perf_counter() - start
        for t, g in zip(leaves, grads, strict=True):
            t.grad = g  # the caller's gradients as they were
        return seconds

    for _ in range(warmup):
        call()
    with measuring():  # each plan's timed driver made and called once, not timed
        call()
    untimed, timed, runs = [], [], []
    for _ in range(repeat):
        untimed.append(call())
        with measuring() as calls:
            timed.append(call())
        runs.append(calls)
    shapes = {tuple((name, len(r)) for name, r in calls) for calls in runs}
    if len(shapes) != 1 or not runs[0]:
        raise RuntimeError(
            "profile: the calls ran no compiled plan, or different plans from call to call "
            f"({len(shapes)} different sequences); is the backend the reference interpreter?"
        )
    kernels, sums = [], np.zeros(repeat)
    for j, (name, _) in enumerate(runs[0]):
        per_call = np.array([np.diff(calls[j][1]) for calls in runs])
        kernels += [(name, float(s)) for s in np.median(per_call, axis=0)]
        sums += per_call.sum(axis=1)
    shares = tuple(float(k / t) for k, t in zip(sums, timed, strict=True))
    return KernelProfile(
        tuple(kernels), statistics.median(untimed), statistics.median(timed), shares
    )


def _copied(tree):
    def copy(leaf):
        if not isinstance(leaf, Tensor):
            return leaf
        return Tensor(np.array(leaf.numpy()), requires_grad=leaf.requires_grad)

    return tree_map(copy, tree)
