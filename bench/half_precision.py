"""bfloat16 against float32 on the bench models: the bytes a step saves for backward with
`saved_dtype=bp.bfloat16` (float32 arithmetic), and the compiled value_and_grad step time with
everything in bfloat16 against float32, side by side (interleaved rounds, one pinned thread).

    python -m backplan.bench.half_precision [--small] [--models mlp,transformer,ln_gelu]
        [--widened]

--widened adds a third runner in the same rounds: bfloat16 with every GEMM operand widened
into a float32 copy first, as compiled plans did before the GEMM read bfloat16 itself.
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

    def __init__(self, name: str, small: bool, dtype, widened: bool = False):
        spec = MODELS[name]
        data = spec.inputs(small, np.float32)
        self.params = {k: bp.tensor(v.astype(dtype)) for k, v in data.params.items()}
        self.batch = [b.astype(dtype) if b.dtype.kind == "f" else b for b in data.batch(True)]
        self.fn = bp.compile(bp.value_and_grad(_bound(spec)))
        self.cpu_ms: list[float] = []
        with _gemm_operands_widened() if widened else contextlib.nullcontext():
            self.step()  # plans are made (and lowered) at the first call

    def step(self):
        start = time.process_time()
        self.fn(self.params, *self.batch)
        self.cpu_ms.append((time.process_time() - start) * 1e3)


@contextlib.contextmanager
def _gemm_operands_widened():
    """Plans lowered inside widen bfloat16 GEMM operands into float32 copies (the old way)."""
    from .internals import widen

    keep = widen.reads_bf16_operands
    widen.reads_bf16_operands = lambda node, inputs: False
    try:
        yield
    finally:
        widen.reads_bf16_operands = keep


def _bound(spec):
    loss = LOSSES[spec.kind]
    return lambda params, *batch: loss(params, *batch, **spec.static)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--models", default="mlp,transformer,ln_gelu")
    parser.add_argument("--widened", action="store_true", help="also time the old bf16 GEMMs")
    args = parser.parse_args(argv)
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
            runners["bf16 widened"] = _Step(name, args.small, bp.bfloat16, widened=True)
        steps = {
            k: schedule.steps_per_round(warm_up(r, schedule.warmup_steps))
            for k, r in runners.items()
        }
        for runner in runners.values():
            runner.cpu_ms.clear()
        timings = timed_rounds(runners, steps, schedule)
        f32_ms, bf16_ms = (timings[k].median * 1e3 for k in ("f32", "bf16"))
        print(f"{name}: step f32 {f32_ms:.2f} ms, bf16 {bf16_ms:.2f} ms ({bf16_ms / f32_ms:.2f}x)")
        f32_cpu, bf16_cpu = (statistics.median(runners[k].cpu_ms) for k in ("f32", "bf16"))
        print(
            f"{name}: CPU time f32 {f32_cpu:.2f} ms, bf16 {bf16_cpu:.2f} ms "
            f"({bf16_cpu / f32_cpu:.2f}x)"
        )
        if args.widened:
            old_ms = timings["bf16 widened"].median * 1e3
            print(
                f"{name}: bf16 with widened GEMM operands {old_ms:.2f} ms ({old_ms / f32_ms:.2f}x)"
            )


if __name__ == "__main__":
    main()
