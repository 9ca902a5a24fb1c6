"""bfloat16 against float32 on the bench models: the bytes a step saves for backward with
`saved_dtype=bp.bfloat16` (float32 arithmetic), and the compiled value_and_grad step time with
everything in bfloat16 against float32, side by side (interleaved rounds, one pinned thread).

    python -m backplan.bench.half_precision [--small] [--models mlp,transformer,ln_gelu]
        [--widened] [--float16] [--unspread]

--unspread adds runners whose plans widen a 16-bit operand of a smaller shape (a bias) in a
loop of its own, as before ir/fusion.py recomputed such widenings where they are read.
--widened adds a runner in the same rounds: bfloat16 with every GEMM operand widened into a
float32 copy first, as compiled plans did before the GEMM read bfloat16 itself. --float16 adds
one with everything in float16 (its matmuls on the own GEMM, which widens while packing;
convolutions and attention widen their operands into float32 copies; loops convert with
F16C), and with --widened also float16 with float32 copies for BLAS for every product (how
products below the own GEMM's float32 crossover ran before).
Each step is also timed by the process's CPU time (all its threads, on the one pinned CPU;
medians printed beside the wall times): on a shared, loaded machine a step's wall time counts
the neighbours' slices too.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import numpy as np

import backplan as bp

from .affinity import pin_process
from .measure import FULL, QUICK, timed_rounds, warm_up
from .models import MODELS, transformer
from .models import ln_gelu as ln_gelu_model
from .models import mlp as mlp_model

LOSSES = {"mlp": mlp_model.loss, "transformer": transformer.loss, "ln_gelu": ln_gelu_model.loss}


def saved_bytes(name: str, small: bool, saved_dtype) -> int:
    """Bytes a compiled forward saves for backward, the user's own arrays excluded."""
    spec = MODELS[name]
    data = spec.inputs(small, np.float32)
    params = {k: bp.tensor(v, requires_grad=True) for k, v in data.params.items()}
    loss = bp.compile(_bound(spec), saved_dtype=saved_dtype)(params, *data.batch(True))
    return sum(b.nbytes for b in loss.grad_fn.saved_buffers if not b.is_region_input)


class _Step:
    """One compiled value_and_grad step of a model in one dtype."""

    numpy_allocations = False

    def __init__(self, name: str, small: bool, dtype, lowering=contextlib.nullcontext):
        spec = MODELS[name]
        data = spec.inputs(small, np.float32)
        self.params = {k: bp.tensor(v.astype(dtype)) for k, v in data.params.items()}
        self.batch = [b.astype(dtype) if b.dtype.kind == "f" else b for b in data.batch(True)]
        self.fn = bp.compile(bp.value_and_grad(_bound(spec)))
        self.cpu_ms: list[float] = []
        with lowering():
            self.step()  # plans are made (and lowered) at the first call

    def step(self):
        start = time.process_time()
        self.fn(self.params, *self.batch)
        self.cpu_ms.append((time.process_time() - start) * 1e3)


@contextlib.contextmanager
def _gemm_operands_widened():
    """Plans lowered inside widen 16-bit GEMM operands into float32 copies (the old way)."""
    from .internals import widen

    keep = widen.reads_half_operands
    widen.reads_half_operands = lambda node, inputs: False
    try:
        yield
    finally:
        widen.reads_half_operands = keep


@contextlib.contextmanager
def _widenings_unspread():
    """Plans lowered inside give each 16-bit widening of a smaller shape its own loop, read
    back as float32 (as before ir/fusion.py recomputed them where larger loops read them)."""
    from .internals import fusion

    keep = fusion._spread_widenings
    fusion._spread_widenings = lambda graph: frozenset()
    try:
        yield
    finally:
        fusion._spread_widenings = keep


def _bound(spec):
    loss = LOSSES[spec.kind]
    return lambda params, *batch: loss(params, *batch, **spec.static)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--models", default="mlp,transformer,ln_gelu")
    parser.add_argument("--widened", action="store_true", help="also time the old 16-bit GEMMs")
    parser.add_argument("--float16", action="store_true", help="also time float16 steps")
    parser.add_argument(
        "--unspread", action="store_true", help="also time 16-bit widenings in loops of their own"
    )
    args = parser.parse_args(argv)
    kinds = ", ".join(sorted(LOSSES))
    for name in args.models.split(","):
        if name not in MODELS or MODELS[name].kind not in LOSSES:
            parser.error(f"--models {name}: the models of kind {kinds} run here (not cnn, lstm)")
    print(pin_process(1), "BACKPLAN_BACKEND", os.environ.get("BACKPLAN_BACKEND", "numba"))
    schedule = QUICK if args.small else FULL
    for name in args.models.split(","):
        f32, bf16 = saved_bytes(name, args.small, None), saved_bytes(name, args.small, bp.bfloat16)
        ratio = bf16 / max(f32, 1)
        print(f"{name}: saved {f32:,} B float32, {bf16:,} B saved_dtype=bfloat16 ({ratio:.3f}x)")
        runners = {
            "f32": _Step(name, args.small, np.float32),
            "bf16": _Step(name, args.small, bp.bfloat16),
        }
        if args.widened:
            runners["bf16 widened"] = _Step(name, args.small, bp.bfloat16, _gemm_operands_widened)
        if args.float16:
            runners["f16"] = _Step(name, args.small, np.float16)
        if args.unspread:
            runners["bf16 unspread"] = _Step(name, args.small, bp.bfloat16, _widenings_unspread)
        if args.unspread and args.float16:
            runners["f16 unspread"] = _Step(name, args.small, np.float16, _widenings_unspread)
        if args.float16 and args.widened:
            runners["f16 widened"] = _Step(name, args.small, np.float16, _gemm_operands_widened)
        steps = {
            k: schedule.steps_per_round(warm_up(r, schedule.warmup_steps))
            for k, r in runners.items()
        }
        for runner in runners.values():
            runner.cpu_ms.clear()
        _report(name, runners, timed_rounds(runners, steps, schedule))


def _report(name: str, runners: dict, timings: dict) -> None:
    """Each 16-bit runner's median wall and process CPU time against float32's."""
    f32_ms = timings["f32"].median * 1e3
    f32_cpu = statistics.median(runners["f32"].cpu_ms)
    for key in (k for k in runners if k != "f32"):
        ms, cpu = timings[key].median * 1e3, statistics.median(runners[key].cpu_ms)
        print(f"{name}: step f32 {f32_ms:.2f} ms, {key} {ms:.2f} ms ({ms / f32_ms:.2f}x)")
        print(f"{name}: CPU time f32 {f32_cpu:.2f} ms, {key} {cpu:.2f} ms ({cpu / f32_cpu:.2f}x)")


if __name__ == "__main__":
    main()
