"""What a memory budget costs: each model's value_and_grad step under the default plan and under
plans holding at most 1/3 and 1/5 of the default plan's saved bytes (the planner's cheapest;
--saved-dtype bf16 adds the plans allowed bfloat16 saved buffers), step times in interleaved
rounds, what each plan recomputes, and the planner's own time on a step of about 10,000 nodes.
--frontier N times N rows of fn.memory_frontier instead (peak, saved bytes, added FLOPs, step).

    python -m backplan.bench.memory_budget [--rounds 7] [--models mlp_deep,transformer6]
        [--no-time] [--threads 1] [--saved-dtype bf16] [--frontier 8 [--plot frontier.png]]
        [--clock cpu]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import numpy as np

import backplan as bp
from backplan.bench.internals import plan_frontier, runner_for

from .affinity import pin_process
from .budget_models import FRACTIONS, MODEL_MAKERS, deep_chain, transformer6
from .environment import cpu_name
from .measure import interleaved_medians


def plans_under_budgets(fn, params, batch, saved_dtype=None):
    """[(label, EvaluatedPoint)]: the default plan, then the planner's cheapest plan holding at
    most each fraction of the default plan's saved bytes (saved_dtype: bp.bfloat16 lets it
    keep the saved buffers in bfloat16, `allow_saved_dtype`), and the step's FLOPs."""
    planners = {None: bp.value_and_grad(fn).trace(params, *batch).planner}
    if saved_dtype is not None:
        traced = bp.value_and_grad(fn, allow_saved_dtype=saved_dtype).trace(params, *batch)
        planners[saved_dtype] = traced.planner
    base = planners[None]
    default = base.points("saved")[0]
    saved = default.held_bytes
    rows = [("default", base.evaluate(default))]
    for dtype, planner in planners.items():
        for fraction in FRACTIONS[1:]:
            found = planner.cheapest_saved(int(saved * fraction))
            label = f"saved <= 1/{round(1 / fraction)}" + (" (bf16 allowed)" if dtype else "")
            rows.append((label, found))
    return rows, base.step_flops(), [params, *batch]


def recompute_floor(planner, limit: int) -> int:
    """A lower bound on the FLOPs any plan must add by recomputing (full precision) to hold at
    most limit saved bytes. The values it stops holding must free the excess, and each is
    rebuilt by at least its chain back to the values the default plan holds (more when those
    are dropped too); a forward node in several chains is shared out among them, so summing
    shares never counts more than a plan copies. Fractional knapsack, most bytes per FLOP
    first: no recomputation plan adds less, and a target below it needs another means."""
    schedule = planner.choices.schedule
    chains = {i: _base_chain(schedule, i) for i in schedule.held}
    sharing: dict[int, int] = {}
    for chain in chains.values():
        for node in chain:
            sharing[node] = sharing.get(node, 0) + 1
    items = []
    for i, chain in chains.items():
        cost = sum(schedule.flops[n] / sharing[n] for n in chain)
        items.append((schedule.held_nbytes[i] / max(cost, 1e-9), schedule.held_nbytes[i], cost))
    floor, excess = 0.0, schedule.held_bytes() - limit
    for _, nbytes, cost in sorted(items, reverse=True):
        if excess <= 0:
            break
        floor += cost * (min(1.0, excess / nbytes) if nbytes else 1.0)
        excess -= nbytes
    return int(floor)


def _base_chain(schedule, start: int) -> set[int]:
    """start and the forward nodes it is computed from, back to the inputs and the values the
    default plan holds."""
    chain, stack = {start}, [start]
    while stack:
        for i in schedule.producer.get(stack.pop(), ()):
            if i not in chain and i not in schedule.available and i not in schedule.held_set:
                chain.add(i)
                stack.append(i)
    return chain


def recomputed_ops(planner, point) -> str:
    """Which forward ops a plan recomputes, by op and shape, with their share of the added
    FLOPs: where its added time goes."""
    schedule = planner.choices.schedule
    outcome = schedule.simulate(point.drop)
    flops: dict[str, int] = {}
    counts: dict[str, int] = {}
    for i in outcome.recomputed:
        value = schedule.values[i]
        key = f"{value.op} {value.type}"
        flops[key] = flops.get(key, 0) + schedule.flops[i]
        counts[key] = counts.get(key, 0) + 1
    total = max(sum(flops.values()), 1)
    ranked = sorted(flops, key=lambda k: -flops[k])
    return ", ".join(
        f"{counts[k]} x {k} ({100 * flops[k] / total:.0f}%)" for k in ranked if flops[k]
    )


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


def relative_error(first: list, other: list) -> float:
    """|other - first| / |first| over every output together (norms): what reading rounded
    (bfloat16) saved buffers changes. Not output by output: a gradient that is zero in exact
    arithmetic (a transformer's key bias, which softmax cancels) is float noise in both plans,
    and its own relative error is meaningless (about 1.5 on the bench transformer)."""
    diff = sum(
        float(np.sum((np.asarray(b, np.float64) - a) ** 2))
        for a, b in zip(first, other, strict=True)
    )
    norm = sum(float(np.sum(np.asarray(a, np.float64) ** 2)) for a in first)
    return (diff / max(norm, 1e-300)) ** 0.5


def time_plans(plans, arrays: list, rounds: int, rounding=None) -> list[float]:
    """Median ms per step of each plan, rounds interleaved; refuses full-precision plans whose
    values or gradients differ from the first (default) plan's; for plan k reading bfloat16
    saved buffers (rounding[k]) prints the largest relative error of its outputs instead."""
    runners, outputs, flat = plan_outputs(plans, arrays)
    rounding = rounding or [False] * len(plans)
    for k, (plan, out) in enumerate(zip(plans[1:], outputs[1:], strict=True), start=1):
        if rounding[k]:
            print(
                f"  plan {k} (bfloat16 saved buffers): outputs within "
                f"{relative_error(outputs[0], out):.2e} of the default plan's (norm)"
            )
        elif not same_outputs(outputs[0], out):
            raise RuntimeError(f"{plan.graph.name}: a budgeted plan's outputs differ")
    steps = {i: (lambda run=run: run(list(flat))) for i, run in enumerate(runners)}
    if CLOCK[0] == "cpu":
        medians = cpu_medians(steps, rounds)
    else:
        medians = interleaved_medians(steps, rounds, 0.0, count=1)
    return [medians[i] for i in steps]


CLOCK = ["wall"]  # --clock cpu: time steps by the process's CPU time instead


def cpu_medians(steps: dict, rounds: int) -> dict:
    """{name: median ms of CPU time per step}, one step of each per round, interleaved. On a
    machine shared with other work, a pinned single-threaded step's CPU time is its own work
    (plus cache and memory-bus contention), where its wall time also counts the time slices
    other processes took from its CPU."""
    samples: dict = {name: [] for name in steps}
    wall: dict = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            start, started = time.process_time(), time.perf_counter()
            step()
            samples[name].append((time.process_time() - start) * 1e3)
            wall[name].append((time.perf_counter() - started) * 1e3)
    walls = ", ".join(f"{statistics.median(v):.2f}" for v in wall.values())
    print(f"  (the same steps' wall-clock medians, ms: {walls})")
    return {name: statistics.median(values) for name, values in samples.items()}


def cpu_timed(fn) -> tuple[float, object]:
    """(CPU seconds of this process, result) of one call: on a shared machine the wall time
    of a single-threaded planner counts other people's work too."""
    start = time.process_time()
    result = fn()
    return time.process_time() - start, result


def planning_time() -> str:
    """The planner's time on a joint plan of about 10,000 nodes, in parts (CPU seconds): the
    trace and pipeline to the default plan; the frontier as the planner simulates it (the
    peaks it ranks plans by); `memory_frontier` as users call it, each row's plan built and
    lowered for its compiled peak (what max_peak_bytes reads); a full collection while the
    function holds them (it walks every object the collector tracks); then freeing those plans
    once the function is gone: reference counting as it is dropped, and the full collection after
    (the planner pauses the cyclic collector while it builds them, ir/gc_pause.py: anything
    left in cycles would wait for that collection)."""
    nodes, traced, simulated, plans, rows, found, held = _planned_frontier()
    gc.collect()  # what the planning left for the collector, so the next one only walks
    tracked = len(gc.get_objects())  # what each full collection walks while the function lives
    living, _ = cpu_timed(gc.collect)
    dropped, _ = cpu_timed(held.clear)  # the function, its entry and the rows' plans
    freed, _ = cpu_timed(gc.collect)
    return (
        f"planning a {nodes}-node joint plan (CPU s): trace and default plan "
        f"{traced:.3f}, the planner's frontier ({plans} plans, simulated peaks) "
        f"{simulated:.3f}, memory_frontier ({found} rows, each plan lowered for "
        f"its compiled peak) {rows:.3f}, a full collection while the function lives "
        f"{living:.3f} ({tracked:,} objects tracked), then freeing its plans when the "
        f"function goes {dropped:.3f} + the full collection after {freed:.3f}; trace + "
        f"planner's frontier {traced + simulated:.3f}"
    )


def _planned_frontier() -> tuple:
    """planning_time's parts: (nodes, trace, simulated frontier, its plans, memory_frontier,
    its rows, [the function, its entry]): clearing that list drops the last references."""
    fn, params, batch = deep_chain()
    step = bp.value_and_grad(fn)
    traced, entry = cpu_timed(lambda: step.trace(params, *batch))
    schedule = entry.planner.choices.schedule
    simulated, points = cpu_timed(lambda: plan_frontier(schedule))
    rows, frontier = cpu_timed(lambda: step.memory_frontier(params, *batch))
    found = (len(schedule.steps), traced, simulated, len(points), rows, len(frontier.points))
    return (*found, [step, entry])


def row_parts(rows: int = 5) -> str:
    """Where a frontier row's time goes (CPU ms, medians over `rows` rows spread along the
    10,000-node plan's candidates, each built once on a fresh trace): building its plan (the
    recomputed copies and liveness), then lowering it for its compiled peak, as
    memory_frontier does for every row (the collector paused, as the planner runs)."""
    from backplan.bench.internals import paused_gc, step_peak_bytes

    fn, params, batch = deep_chain()
    planner = bp.value_and_grad(fn).trace(params, *batch).planner
    points = planner.points()
    chosen = [points[round(k * (len(points) - 1) / (rows - 1))] for k in range(rows)][1:]
    built, lowered = [], []
    with paused_gc():
        for point in chosen:
            seconds, plans = cpu_timed(lambda p=point: planner.build(p.drop))
            built.append(seconds)
            lowered.append(cpu_timed(lambda p=plans: step_peak_bytes(p))[0])
    return (
        f"a frontier row of it (CPU ms, median of {len(chosen)}): plan built "
        f"{1000 * statistics.median(built):.0f}, lowered for its peak "
        f"{1000 * statistics.median(lowered):.0f}"
    )


def step_planning_time() -> str:
    """The transformer x 6 training step's trace (adam, donated) in CPU seconds, its updates
    in the traced order (BACKPLAN_EARLY_UPDATES=0: no plan lowered while tracing) and right
    after their gradients (the default: both orders lowered, to keep the lower peak); the
    kept plan's lowering is reused by the compile. Best of three traces each."""
    from .early_updates import updates
    from .memory_budget_train import train_step

    fn, params, batch = transformer6()
    opt = bp.optim.adam(1e-3)
    tensors = bp.tree.map(bp.tensor, params)
    args = [tensors, opt.init(tensors), *map(bp.tensor, batch)]
    found = {}
    for early in (False, True):
        with updates(early):
            found[early] = min(
                cpu_timed(lambda: train_step(fn, opt).trace(*args))[0] for _ in range(3)
            )
    return (
        f"transformer x 6 training step, trace (CPU s): updates as traced {found[False]:.3f}, "
        f"right after their gradients {found[True]:.3f}"
    )


def budget_rows(name: str, rounds: int, saved_dtype, timed: bool) -> None:
    """The issue's targets: the default plan and the cheapest plans at 1/3 and 1/5 of its
    saved bytes, timed side by side, with what each recomputes."""
    fn, params, batch = MODEL_MAKERS[name]()
    rows, step_flops, arrays = plans_under_budgets(fn, params, batch, saved_dtype)
    found = [(label, e) for label, e in rows if e is not None]
    plans = [e.plans.plan for _, e in found]
    rounding = [e.saved_dtype is not None for _, e in found]
    times = time_plans(plans, arrays, rounds, rounding) if timed else []
    planner = bp.value_and_grad(fn).trace(params, *batch).planner
    print("| model | plan | saved bytes | peak | added FLOPs | step (ms) | vs default |")
    print("|---|---|---|---|---|---|---|")
    for k, (label, e) in enumerate(found):
        step = f"{times[k]:.2f} | {times[k] / times[0]:.3f}x" if times else "not timed | -"
        dtype = f", saved in {e.saved_dtype}" if e.saved_dtype else ""
        print(
            f"| {name} | {label}{dtype} | {e.saved_bytes:,} | {e.peak_bytes:,} | "
            f"+{100 * e.added_flops / step_flops:.1f}% | {step} |"
        )
    saved = planner.points("saved")[0].held_bytes
    for label, e in found[1:]:
        print(f"  {name} {label}: recomputes {recomputed_ops(planner, e) or 'nothing'}")
    for fraction in FRACTIONS[1:]:
        floor = recompute_floor(planner, int(saved * fraction))
        print(
            f"  {name} saved <= 1/{round(1 / fraction)}: no recomputation plan adds less than "
            f"+{100 * floor / step_flops:.1f}% FLOPs (floor: each value no longer held "
            "recomputed once, most bytes per FLOP first)"
        )


def frontier_rows(name: str, rounds: int, saved_dtype, count: int) -> list[dict]:
    """fn.memory_frontier's rows (what max_peak_bytes chooses from, on this backend), up to
    count of them spread along it, each plan compiled and timed side by side."""
    fn, params, batch = MODEL_MAKERS[name]()
    traced = bp.value_and_grad(fn, allow_saved_dtype=saved_dtype).trace(params, *batch)
    planner = traced.planner
    frontier = planner.frontier()
    picked = sorted({round(k * (len(frontier) - 1) / max(count - 1, 1)) for k in range(count)})
    chosen = [frontier[k] for k in picked]
    rounding = [e.saved_dtype is not None for e in chosen]
    times = time_plans([e.plans.plan for e in chosen], [params, *batch], rounds, rounding)
    step_flops = planner.step_flops()
    rows = [
        dict(row=k, peak=e.peak_bytes, saved=e.saved_bytes, recomputed=e.recomputed,
             added=e.added_flops / step_flops, dtype=e.saved_dtype, ms=ms, ratio=ms / times[0])
        for k, e, ms in zip(picked, chosen, times, strict=True)
    ]  # fmt: skip
    print(f"{name}: {len(frontier)} frontier rows, {len(chosen)} timed")
    print("| row | peak | saved | added FLOPs | recomputed | saved as | step (ms) | vs default |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['row']} | {r['peak']:,} | {r['saved']:,} | +{100 * r['added']:.1f}% | "
            f"{r['recomputed']} | {r['dtype'] or 'as computed'} | {r['ms']:.2f} | "
            f"{r['ratio']:.3f}x |"
        )
    return rows


def plot_frontiers(found: dict[str, list[dict]], path: str) -> None:
    """One panel per model: step peak against added FLOPs, each timed row labelled with its
    step time against the default plan's; rows reading bfloat16 saved buffers marked apart."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(4 * len(found), 3.2), dpi=80)
    for k, (name, rows) in enumerate(found.items()):
        axes = figure.add_subplot(1, len(found), k + 1)
        added = [100 * r["added"] for r in rows]
        peaks = [r["peak"] / 2**20 for r in rows]
        axes.step(added, peaks, where="post", color="#4c72b0", linewidth=1)
        for r, x, y in zip(rows, added, peaks, strict=True):
            axes.plot(
                x, y, "s" if r["dtype"] else "o", color="#c44e52" if r["dtype"] else "#4c72b0"
            )
            axes.annotate(f"{r['ratio']:.2f}x", (x, y), textcoords="offset points", xytext=(4, 4),
                          fontsize=7)  # fmt: skip
        axes.set_title(name, fontsize=9)
        axes.set_xlabel("added FLOPs (% of the step)", fontsize=8)
        axes.set_ylabel("step peak (MiB)", fontsize=8)
        axes.tick_params(labelsize=7)
    figure.tight_layout()
    figure.savefig(path)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--models", default="mlp_deep,transformer6")
    parser.add_argument("--no-time", action="store_true", help="plans only, no compiled steps")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--saved-dtype", choices=("bf16",), help="also plans allowed bfloat16 saved buffers"
    )
    parser.add_argument("--frontier", type=int, default=0, help="time N frontier rows instead")
    parser.add_argument("--plot", help="with --frontier: draw the timed rows (PNG, matplotlib)")
    parser.add_argument(
        "--clock", choices=("wall", "cpu"), default="wall", help="cpu: steps' CPU time"
    )
    args = parser.parse_args(argv)
    if args.frontier and args.no_time:
        parser.error("--frontier times its rows' compiled steps; --no-time cannot apply to it")
    CLOCK[0] = args.clock
    dtype = bp.bfloat16 if args.saved_dtype else None
    print(f"CPU: {cpu_name()}; {pin_process(args.threads)['affinity']}; clock: {args.clock}")
    print(planning_time(), flush=True)
    print(row_parts(), flush=True)
    print(step_planning_time(), flush=True)
    found = {}
    for name in args.models.split(","):
        if args.frontier:
            found[name] = frontier_rows(name, args.rounds, dtype, args.frontier)
        else:
            budget_rows(name, args.rounds, dtype, not args.no_time)
    if args.plot and found:
        plot_frontiers(found, args.plot)


if __name__ == "__main__":
    main()
