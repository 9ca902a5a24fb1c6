"""A value_and_grad step with its arguments in C order against the same arguments in other
layouts: F-order weights (np.asfortranarray: a Fortran array, or a torch-style (out, in) weight
passed as w.T), reversed weights (w[::-1] of a C-ordered array), a broadcast mask and sliced
views (every other column, column slices, every other row), which the plan reads in place
(ir/in_place_inputs.py; a GEMM reading a reversed or sliced operand copies it into the scratch
arena first), and a weight through DLPack, copied at every call.

    python -m backplan.bench.argument_layouts --rows 64 --rounds 11 --threads 1 [--memory]

The step: 512 -> 2048 (tanh, times a mask) -> 1024 (gelu), float32 weights (12 MiB), a sum of
squares; the mask is one row broadcast over the batch (np.broadcast_to), passed as that view
("broadcast": read with stride 0) or copied into C order (every other row). "sliced ::2" passes
w1[:, ::2] of a wider array, "columns" w1 and w2 as column slices of wider arrays, "rows ::2"
the mask as every other row of a taller one: read in place as slices of the arrays they view
(a GEMM copies a sliced operand into the arena first). "DLPack" passes w1[:, ::2] through
np.from_dlpack, as a torch tensor's slice arrives (the array it views unknown): copied at every
call, counted as `copies`. Every layout runs in one
process, rounds interleaved; medians of each round's median per call, the ratio to C order, the
copies and the peak explain prints for one call, and whether the loss is the same.
"""

from __future__ import annotations

import argparse
import gc

import numpy as np

import backplan as bp

from .affinity import pin_process
from .environment import load_average
from .measure import interleaved_medians
from .threads import apply_threads


def loss(p, x, m):
    h = bp.tanh(x @ p["w1"]) * m
    h2 = bp.gelu(h @ p["w2"].T)
    return bp.sum(h2 * h2) * (1.0 / 64)


def layouts(w1: np.ndarray, w2: np.ndarray, m: np.ndarray) -> dict:
    """(w1, w2, m) per layout; m is a mask of (rows, 2048), one row broadcast."""
    full = np.ascontiguousarray(m)
    return {
        "C": (w1, w2, full),
        "F-order": (np.asfortranarray(w1), np.asfortranarray(w2), full),
        "reversed": (
            np.ascontiguousarray(w1[::-1])[::-1],
            np.ascontiguousarray(w2[::-1])[::-1],
            full,
        ),
        "broadcast": (w1, w2, m),
        "sliced ::2": (np.repeat(w1, 2, axis=1)[:, ::2], w2, full),
        "columns": (_columns(w1, 256), _columns(w2, 128), full),
        "rows ::2": (w1, w2, np.repeat(full, 2, axis=0)[1::2]),
        "DLPack": (np.from_dlpack(np.repeat(w1, 2, axis=1)[:, ::2]), w2, full),
    }


def _columns(w: np.ndarray, more: int) -> np.ndarray:
    """w's values as a column slice of a wider C-ordered array (`more` columns either side)."""
    return np.pad(w, ((0, 0), (more, more)))[:, more : more + w.shape[1]]


def _status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    return 0


def resident_growth(call) -> int:
    """VmHWM after one call minus VmRSS before it (the peak's count reset first)."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS")
    result = call()
    grown = _status("VmHWM") - before
    del result
    return grown


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--seconds", type=float, default=0.3, help="per sample")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--memory",
        action="store_true",
        help="also the growth of peak resident memory over one call of each layout (run with "
        "MALLOC_MMAP_THRESHOLD_=0 MALLOC_TRIM_THRESHOLD_=0 so freed blocks go back)",
    )
    args = parser.parse_args(argv)
    pin_process(args.threads)
    apply_threads(args.threads)
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((512, 2048)).astype(np.float32) * 0.05
    w2 = rng.standard_normal((1024, 2048)).astype(np.float32) * 0.05
    x = rng.standard_normal((args.rows, 512)).astype(np.float32)
    m = np.broadcast_to((rng.random(2048) > 0.1).astype(np.float32), (args.rows, 2048))
    step = bp.compile(bp.value_and_grad(loss))
    calls, losses, copies, grown = {}, {}, {}, {}
    for name, (a, b, c) in layouts(w1, w2, m).items():
        arguments = ({"w1": a, "w2": b}, x, c)
        for _ in range(3):
            losses[name] = float(step(*arguments)[0])
        step.wait_until_compiled()
        peak = step.explain(*arguments).call_peak
        copies[name] = (peak.at_peak().get("copies", 0), peak.peak_bytes)
        calls[name] = lambda arguments=arguments: step(*arguments)
        if args.memory:
            grown[name] = resident_growth(calls[name])
    medians = interleaved_medians(calls, args.rounds, args.seconds, settle=1)
    print(f"rows {args.rows}, load {load_average():.1f}, {args.rounds} interleaved rounds")
    for name, ms in medians.items():
        copied, peak = copies[name]
        memory = f"  resident growth {grown[name]:,} B" if args.memory else ""
        print(
            f"  {name:10} {ms:8.2f} ms  {ms / medians['C']:.3f}x C  copies {copied:,} B"
            f"  call peak {peak:,} B{memory}  same loss as C: {losses[name] == losses['C']}"
        )


if __name__ == "__main__":
    main()
