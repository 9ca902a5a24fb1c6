"""A value_and_grad step with its weights in C order against the same weights in another layout:
F-order (np.asfortranarray: a Fortran array, or a torch-style (out, in) weight passed as w.T) and
reversed (w[::-1] of a C-ordered array), which the plan reads in place (ir/in_place_inputs.py;
a GEMM reading a reversed operand copies it into the scratch arena first).

    python -m backplan.bench.argument_layouts --rows 64 --rounds 11 --threads 1

The step: 512 -> 2048 (tanh) -> 1024 (gelu), float32 weights (12 MiB), a sum of squares. Every
layout runs in one process, rounds interleaved; medians of each round's median per call, the
ratio to C order, the copies and the peak explain prints for one call, and whether the loss
is the same.
"""

from __future__ import annotations

import argparse

import numpy as np

import backplan as bp

from .affinity import pin_process
from .environment import load_average
from .measure import interleaved_medians
from .threads import apply_threads


def loss(p, x):
    h = bp.tanh(x @ p["w1"])
    h2 = bp.gelu(h @ p["w2"].T)
    return bp.sum(h2 * h2) * (1.0 / 64)


def layouts(w1: np.ndarray, w2: np.ndarray) -> dict:
    return {
        "C": (w1, w2),
        "F-order": (np.asfortranarray(w1), np.asfortranarray(w2)),
        "reversed": (np.ascontiguousarray(w1[::-1])[::-1], np.ascontiguousarray(w2[::-1])[::-1]),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--seconds", type=float, default=0.3, help="per sample")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    pin_process(args.threads)
    apply_threads(args.threads)
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((512, 2048)).astype(np.float32) * 0.05
    w2 = rng.standard_normal((1024, 2048)).astype(np.float32) * 0.05
    x = rng.standard_normal((args.rows, 512)).astype(np.float32)
    step = bp.compile(bp.value_and_grad(loss))
    calls, losses, copies = {}, {}, {}
    for name, (a, b) in layouts(w1, w2).items():
        arguments = ({"w1": a, "w2": b}, x)
        for _ in range(3):
            losses[name] = float(step(*arguments)[0])
        step.wait_until_compiled()
        peak = step.explain(*arguments).call_peak
        copies[name] = (peak.at_peak().get("copies", 0), peak.peak_bytes)
        calls[name] = lambda arguments=arguments: step(*arguments)
    medians = interleaved_medians(calls, args.rounds, args.seconds, settle=1)
    print(f"rows {args.rows}, load {load_average():.1f}, {args.rounds} interleaved rounds")
    for name, ms in medians.items():
        print(
            f"  {name:9} {ms:8.2f} ms  {ms / medians['C']:.3f}x C  copies {copies[name][0]:,} B"
            f"  call peak {copies[name][1]:,} B"
            f"  same loss as C: {losses[name] == losses['C']}"
        )


if __name__ == "__main__":
    main()
