"""Step time of one compiled function called with bp.tensor arguments and with the same data as
plain NumPy arrays, which the README invites: the difference is what the call path spends on
taking NumPy arguments.

    python -m backplan.bench.call_overhead [--threads 1] [--models mlp_tiny,ln_gelu] [--jax]
        [--backward]

Each model runs `bp.value_and_grad(bp.compile(loss))(params, *batch)` in float32 at full size
(the bench suite's models); rounds interleave the two argument kinds and the medians of the
per-step times are printed in microseconds. Timing starts once the plans' compiled drivers have
replaced the Python ones (driver_builder.wait_for_builds), as in a long training loop. --threads
pins the process to that many CPUs (bench/affinity.py) and limits Numba's and BLAS's threads to
match. --jax adds JAX's step for the same model (the bench suite's JAX peer) to the same rounds,
so both argument kinds are also given as a ratio to JAX measured in the same run.
--backward adds the `@bp.compile` forward followed by `loss.backward()` (bp.zero_grad first,
as a training loop does), the other way to take a step, given as a ratio to the joint plan's
step with tensor arguments: what the split path (two plans, a region, .grad per parameter)
costs beyond the joint one.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace
from types import SimpleNamespace

import numpy as np

from .affinity import cpu_list_text, current_affinity, pin_process
from .measure import Schedule, time_call, timed_rounds

DEFAULT_MODELS = ("mlp_tiny", "ln_gelu")
KINDS = ("tensor", "numpy")


def make_steps(name: str) -> dict:
    """{argument kind: step()} for one bench model, both computing the same thing."""
    import backplan as bp

    from .models import MODELS
    from .peers.backplan_peer import bench_function

    spec = MODELS[name]
    inputs = spec.inputs(small=False, dtype=np.float32)
    fn = bp.value_and_grad(bp.compile(bench_function(spec)), argnums=0)
    numpy_args = (dict(inputs.params), *inputs.batch(spec.train))
    tensor_args = (
        {k: bp.tensor(v) for k, v in inputs.params.items()},
        *[bp.tensor(a) for a in inputs.batch(spec.train)],
    )
    return {
        "tensor": lambda: fn(*tensor_args),
        "numpy": lambda: fn(*numpy_args),
    }


def add_backward_step(steps: dict, name: str) -> dict:
    """steps with kind "backward": `loss = compiled(params, *batch); loss.backward()`."""
    from .models import MODELS
    from .peers.backplan_peer import CompileRunner

    spec = MODELS[name]
    runner = CompileRunner(spec, spec.inputs(small=False, dtype=np.float32))
    return {**steps, "backward": runner.step}


def add_jax_step(steps: dict, name: str) -> dict:
    """steps with the bench suite's JAX step for the model added as kind "jax"."""
    from .models import MODELS
    from .peers import PEERS

    spec = MODELS[name]
    runner = PEERS["jax"]().build(spec, spec.inputs(small=False, dtype=np.float32))
    return {**steps, "jax": runner.step}


def measure(steps: dict, schedule: Schedule) -> dict:
    """Median step seconds per kind over the harness's interleaved rounds (each kind leads
    some rounds)."""
    from backplan.bench.internals import wait_for_builds

    for step in steps.values():
        step()
    wait_for_builds()
    warm = {}
    for kind, step in steps.items():
        for _ in range(schedule.warmup_steps):
            step()
        warm[kind] = statistics.median(time_call(step) for _ in range(3))
    counts = {kind: schedule.steps_per_round(warm[kind]) for kind in steps}
    runners = {kind: SimpleNamespace(step=step) for kind, step in steps.items()}
    timings = timed_rounds(runners, counts, replace(schedule, settle_steps=0))
    return {kind: timing.median for kind, timing in timings.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--round-seconds", type=float, default=0.5)
    parser.add_argument("--jax", action="store_true", help="also time JAX's step, same rounds")
    parser.add_argument(
        "--backward",
        action="store_true",
        help="also time @bp.compile then loss.backward(), same rounds",
    )
    options = parser.parse_args(argv)
    pinned = pin_process(options.threads)
    from .threads import apply_threads

    apply_threads(options.threads)
    schedule = Schedule(
        warmup_steps=5, rounds=options.rounds, round_seconds=options.round_seconds, max_steps=5000
    )
    print(
        f"threads {options.threads}, CPUs {cpu_list_text(current_affinity())} "
        f"({pinned.get('affinity', 'not pinned')}); medians of {options.rounds} interleaved "
        "rounds, microseconds per step"
    )
    header = f"{'model':<10} {'tensor args':>12} {'numpy args':>12} {'numpy/tensor':>13}"
    if options.backward:
        header += f" {'backward()':>11} {'bwd/tensor':>11}"
    print(header + (f" {'jax':>10} {'tensor/jax':>11} {'numpy/jax':>10}" if options.jax else ""))
    for name in options.models.split(","):
        steps = make_steps(name)
        if options.backward:
            steps = add_backward_step(steps, name)
        medians = measure(add_jax_step(steps, name) if options.jax else steps, schedule)
        print(format_row(name, {kind: seconds * 1e6 for kind, seconds in medians.items()}))


def format_row(name: str, us: dict) -> str:
    """One model's medians (microseconds by kind) and the ratios the header names."""
    tensor_us, numpy_us = us["tensor"], us["numpy"]
    row = f"{name:<10} {tensor_us:>12.1f} {numpy_us:>12.1f} {numpy_us / tensor_us:>12.2f}x"
    if "backward" in us:
        row += f" {us['backward']:>11.1f} {us['backward'] / tensor_us:>10.2f}x"
    if "jax" in us:
        jax_us = us["jax"]
        row += f" {jax_us:>10.1f} {tensor_us / jax_us:>10.2f}x {numpy_us / jax_us:>9.2f}x"
    return row


if __name__ == "__main__":
    main()
