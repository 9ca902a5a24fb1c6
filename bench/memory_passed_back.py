"""What explain prints for a loop that passes its results back in, and what the process holds.
Four loops: a non-donated training step as `params, loss = step(params, x)` ("back") and as
`new, loss = step(params, x)` ("apart", the old params kept); one array through a compiled
function as `x = f(x)` ("array") and as `y = f(x)` ("array_apart", x kept).

    python -m backplan.bench.memory_passed_back --mode checked --loop back --width 128
    MALLOC_MMAP_THRESHOLD_=0 MALLOC_TRIM_THRESHOLD_=0 \
        python -m backplan.bench.memory_passed_back --mode vmhwm --loop back --width 2048

Before a loop runs explain counts every result as kept (peak_bytes: exact for "apart" and
"array_apart", an upper bound by the bytes passed back for the others); a second call shows
what the loop does with them (report.loop_observed, report.observed_peak_bytes).
checked: the checked mode's count of the step's own buffers per call, plus the caller's arrays
the step did not allocate, against loop_peak_on_call(n) as printed and as observed. vmhwm: a
fresh process runs two calls, resets its peak resident memory (/proc/self/clear_refs) and
prints VmRSS before the third call and VmHWM after it; a loop and its "apart" twin differ by
what one holds and the other does not, as their observed peaks do.
"""

from __future__ import annotations

import argparse
import ctypes

import numpy as np

import backplan as bp
from backplan.bench.internals import checked_memory, measure

from .memory import proc_status_bytes

CALLS = 4


def model(width: int):
    """(the step, not donated, its params, x): 4 tanh layers and an sgd update."""
    rng = np.random.default_rng(0)
    params = {
        f"w{i}": bp.tensor((rng.standard_normal((width, width)) * 0.02).astype(np.float32))
        for i in range(4)
    }
    x = bp.tensor(rng.standard_normal((64, width)).astype(np.float32))

    def loss(p, x):
        h = x
        for k in sorted(p):
            h = bp.tanh(h @ p[k])
        return bp.sum(h * h)

    vg = bp.value_and_grad(loss)

    def train(p, x):
        value, g = vg(p, x)
        return {k: p[k] - 0.01 * g[k] for k in p}, value

    return train, params, x


def nbytes(tree) -> int:
    return sum(leaf.numpy().nbytes for leaf in bp.tree.leaves(tree))


def array_model(width: int):
    """(a compiled elementwise function, x of width x width float32)."""
    rng = np.random.default_rng(0)
    x = bp.tensor(rng.standard_normal((width, width)).astype(np.float32))
    return bp.compile(lambda x: bp.tanh(x * 1.5) + 0.5), x


class Loop:
    """One of the four loops: `call()` runs its next call; `yours()` the caller's arrays that
    call reads and the step did not allocate (an earlier call's result it did)."""

    def __init__(self, loop: str, width: int):
        self.loop, self.calls, self.kept = loop, 0, None
        self.x = None
        if loop in ("back", "apart"):
            train, self.args, self.x = model(width)
            self.step = bp.compile(train)
        else:
            self.step, self.args = array_model(width)
        self.mine = nbytes(self.args)  # the params or the array you pass in first (not kept)
        self.rest = nbytes(self.x) if self.x is not None else 0

    def arguments(self) -> tuple:
        """The next call's arguments (the same signature on every call)."""
        return (self.args,) if self.x is None else (self.args, self.x)

    def call(self):
        self.calls += 1
        if self.loop == "back":
            self.args, _loss = self.step(self.args, self.x)
        elif self.loop == "apart":
            self.kept = self.step(self.args, self.x)
        elif self.loop == "array":
            self.args = self.step(self.args)
        else:
            self.kept = self.step(self.args)

    def yours(self, n: int) -> int:
        passed_back = self.loop in ("back", "array")
        return self.rest + (0 if passed_back and n > 1 else self.mine)


def checked(loop: str, width: int) -> None:
    with checked_memory():
        run = Loop(loop, width)
        before = bp.explain(run.step, *run.arguments())
        counted = []
        with measure() as measured:
            for _ in range(CALLS):
                measured.restart_at_next_use()
                run.call()
                counted.append(measured.peak)
        after = bp.explain(run.step, *run.arguments())
    total = [c + run.yours(n) for n, c in enumerate(counted, 1)]
    printed = [before.loop_peak_on_call(n).peak_bytes for n in range(1, CALLS + 1)]
    kept = after.loop_observed.kept
    seen = [after.loop_peak_on_call(n, kept if n > 1 else 0).peak_bytes for n in range(1, 5)]
    print(f"loop={loop} passed in first={run.mine + run.rest:,} observed: {after.loop_observed}")
    print("held    :", ", ".join(f"{t:,}" for t in total))
    print("printed :", ", ".join(f"{p:,}" for p in printed), f"(peak_bytes {before.peak_bytes:,})")
    print("observed:", ", ".join(f"{p:,}" for p in seen), f"({after.observed_peak_bytes:,})")


def vmhwm(loop: str, width: int) -> None:
    run = Loop(loop, width)
    for _ in range(2):  # compiles (or loads), then a call of the loop's steady state
        run.call()
    report = bp.explain(run.step, *run.arguments())
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = proc_status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w", encoding="ascii") as file:
        file.write("5")
    run.call()
    hwm = proc_status_bytes("VmHWM")
    print(
        f"loop={loop} VmRSS_before={before:,} VmHWM={hwm:,} growth={hwm - before:,} "
        f"printed_peak={report.peak_bytes:,} observed_peak={report.observed_peak_bytes:,} "
        f"passed_in_first={run.mine + run.rest:,}",
        flush=True,
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backplan.bench.memory_passed_back")
    parser.add_argument("--mode", choices=("checked", "vmhwm"), default="checked")
    parser.add_argument("--loop", choices=("back", "apart", "array", "array_apart"), default="back")
    parser.add_argument("--width", type=int, default=128)
    args = parser.parse_args(argv)
    (checked if args.mode == "checked" else vmhwm)(args.loop, args.width)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
