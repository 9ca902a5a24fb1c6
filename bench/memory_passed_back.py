"""A non-donated training step in the loop `params, loss = step(params, x)` ("back") against the
same step in `new, loss = step(params, x)` ("apart", the old params kept): what explain prints
for each call, and what the process holds.

    python -m backplan.bench.memory_passed_back --mode checked --loop back --width 128
    MALLOC_MMAP_THRESHOLD_=0 MALLOC_TRIM_THRESHOLD_=0 \
        python -m backplan.bench.memory_passed_back --mode vmhwm --loop back --width 2048

checked: the checked mode's count of the step's own buffers per call, plus the caller's arrays
the step did not allocate (x; the params on call 1, and on every call of the "apart" loop),
against loop_peak_on_call(n).peak_bytes. vmhwm: a fresh process runs two calls, resets its peak
resident memory (/proc/self/clear_refs) and prints VmRSS before the third call and VmHWM after
it; the two loops' VmHWM differ by what one holds and the other does not.
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


def checked(loop: str, width: int) -> None:
    train, params, x = model(width)
    p_bytes, x_bytes = nbytes(params), nbytes(x)
    with checked_memory():
        step = bp.compile(train)
        report = bp.explain(step, params, x)
        counted, held = [], [None]
        with measure() as measured:
            for _ in range(CALLS):
                measured.restart_at_next_use()
                if loop == "back":
                    params, _loss = step(params, x)
                else:
                    held[0] = step(params, x)
                counted.append(measured.peak)
    yours = [x_bytes + (p_bytes if loop == "apart" or n == 0 else 0) for n in range(CALLS)]
    total = [c + y for c, y in zip(counted, yours, strict=True)]
    printed = [report.loop_peak_on_call(n).peak_bytes for n in range(1, CALLS + 1)]
    print(f"loop={loop} params={p_bytes:,} x={x_bytes:,}")
    print("held   :", ", ".join(f"{t:,}" for t in total))
    print("printed:", ", ".join(f"{p:,}" for p in printed))
    print(f"peak_bytes {report.peak_bytes:,} call_peak_bytes {report.call_peak_bytes:,}")


def vmhwm(loop: str, width: int) -> None:
    train, params, x = model(width)
    step = bp.compile(train)
    held = None
    for _ in range(2):  # compiles (or loads), then a call of the loop's steady state
        if loop == "back":
            params, _loss = step(params, x)
        else:
            held = step(params, x)
    report = bp.explain(step, params, x)
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = proc_status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w", encoding="ascii") as file:
        file.write("5")
    if loop == "back":
        params, _loss = step(params, x)
    else:
        held = step(params, x)
    hwm = proc_status_bytes("VmHWM")
    del held
    print(
        f"loop={loop} VmRSS_before={before:,} VmHWM={hwm:,} growth={hwm - before:,} "
        f"printed_peak={report.peak_bytes:,} params={nbytes(params):,}"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backplan.bench.memory_passed_back")
    parser.add_argument("--mode", choices=("checked", "vmhwm"), default="checked")
    parser.add_argument("--loop", choices=("back", "apart"), default="back")
    parser.add_argument("--width", type=int, default=128)
    args = parser.parse_args(argv)
    (checked if args.mode == "checked" else vmhwm)(args.loop, args.width)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
