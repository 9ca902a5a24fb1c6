"""What a memory budget costs: each model's value_and_grad step under the default plan and under
plans holding at most 1/3 and 1/5 of the default plan's saved bytes (the planner's cheapest),
step times in interleaved rounds, and the planner's own time on a step of about 10,000 nodes.

    python -m backplan.bench.memory_budget [--rounds 7] [--models mlp_deep,transformer6]
        [--no-time] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import backplan as bp
from backplan.bench.internals import cheapest_within, plan_frontier, runner_for

from .affinity import pin_process
from .environment import cpu_name
from .models import MODELS
from .models import transformer as transformer_model
from .peers.backplan_peer import bench_function

FRACTIONS = (1, 1 / 3, 1 / 5)


def transformer6():
    """The bench transformer's block stacked 6 deep, each block its own parameters."""
    spec = MODELS["transformer"]
    blocks = [spec.inputs(False, np.float32, seed=s) for s in range(6)]

    def stacked(params, x):
        for i in range(6):
            x = transformer_model.block(
                {k[3:]: v for k, v in params.items() if k[:3] == f"b{i}_"}, x, n_heads=4
            )
        return bp.mean(x * x)

    params = {f"b{i}_{k}": v for i, b in enumerate(blocks) for k, v in b.params.items()}
    return stacked, params, blocks[0].batch(True)


def mlp_deep():
    spec = MODELS["mlp_deep"]
    inputs = spec.inputs(False, np.float32)
    return bench_function(spec), inputs.params, inputs.batch(True)


def deep_chain(layers: int = 1120):
    """A tanh MLP of 16-wide layers: about 12 joint-plan nodes per layer."""
    rng = np.random.default_rng(0)
    params = {
        f"w{i}": (rng.standard_normal((16, 16)) * 0.3).astype(np.float32) for i in range(layers)
    }

    def chain(params, x):
        for i in range(layers):
            x = bp.tanh(x @ params[f"w{i}"])
        return bp.mean(x * x)

    return chain, params, (rng.standard_normal((256, 16)).astype(np.float32),)


MODEL_MAKERS = {"mlp_deep": mlp_deep, "transformer6": transformer6}


def plans_under_budgets(fn, params, batch):
    """[(fraction, plan, saved bytes, added FLOPs, step FLOPs)] for each fraction of saved."""
    entry = bp.value_and_grad(fn).trace(params, *batch)
    planner = entry.planner
    points = planner.points("saved")
    saved = points[0].held_bytes
    rows = []
    for fraction in FRACTIONS:
        point = cheapest_within(points, int(saved * fraction), "saved")
        if point is None:
            rows.append((fraction, None, None, None, None))
            continue
        rows.append(
            (
                fraction,
                planner.build(point.drop),
                point.held_bytes,
                point.added_flops,
                planner.step_flops(),
            )
        )
    return rows, [params, *batch]


def plan_outputs(plans, arrays: list) -> tuple[list, list, list]:
    """Each plan's compiled runner, the outputs of its first call and the flat inputs. A
    runner takes over the list it is given (it clears it, so donated buffers have no other
    reference): each call gets a list of its own, or the next plan is called with no inputs."""
    from backplan.bench.internals import flatten

    flat = [np.asarray(a) for a in flatten(arrays)[0]]
    runners = [runner_for(p, {}, background=False) for p in plans]
    return runners, [[np.array(o) for o in run(list(flat))] for run in runners], flat


def same_outputs(first: list, other: list) -> bool:
    """Within float reassociation of each other (a recomputed plan sums in another order)."""
    return all(np.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(first, other, strict=True))


def time_plans(plans, arrays: list, rounds: int) -> list[float]:
    """Median ms per step of each plan, rounds interleaved; refuses plans whose values or
    gradients differ from the first (default) plan's."""
    runners, outputs, flat = plan_outputs(plans, arrays)
    for plan, out in zip(plans[1:], outputs[1:], strict=True):
        if not same_outputs(outputs[0], out):
            raise RuntimeError(f"{plan.graph.name}: a budgeted plan's outputs differ")
    times = [[] for _ in runners]
    for _ in range(rounds):
        for i, run in enumerate(runners):
            args = list(flat)
            start = time.perf_counter()
            run(args)
            times[i].append(time.perf_counter() - start)
    return [1e3 * statistics.median(t) for t in times]


def planning_time() -> tuple[int, float]:
    fn, params, batch = deep_chain()
    entry = bp.value_and_grad(fn).trace(params, *batch)
    schedule = entry.planner.choices.schedule
    start = time.perf_counter()
    points = plan_frontier(schedule)
    return len(schedule.steps), len(points), time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--models", default="mlp_deep,transformer6")
    parser.add_argument("--no-time", action="store_true", help="plans only, no compiled steps")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    print(f"CPU: {cpu_name()}; {pin_process(args.threads)['affinity']}")
    nodes, points, seconds = planning_time()
    print(f"planning (frontier, {points} plans) for a {nodes}-node joint plan: {seconds:.3f} s")
    for name in args.models.split(","):
        rows, arrays = plans_under_budgets(*MODEL_MAKERS[name]())
        found = [r for r in rows if r[1] is not None]
        times = time_plans([r[1] for r in found], arrays, args.rounds) if not args.no_time else []
        base = times[0] if times else None
        for k, (fraction, plan, saved, flops, step) in enumerate(found):
            timed = f"{times[k]:.2f} ms ({times[k] / base:.2f}x)" if times else "not timed"
            print(
                f"{name} saved<={fraction:.2f}x: saved {saved:,} B, peak {plan.peak_bytes:,} B, "
                f"+{100 * flops / step:.1f}% FLOPs, step {timed}"
            )


if __name__ == "__main__":
    main()
