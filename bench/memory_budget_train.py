"""What a memory budget costs on the training step users write: `bp.compile(step,
donate_argnums=(0, 1), saved_bytes_budget=N)` around `bp.value_and_grad(loss)` and adam, N 1/3
and 1/5 of the bytes the default plan's inlined gradients read from its forward. Per plan: those
saved bytes, the predicted peak (explain, the arrays passed in included), the peak the checked
mode measures (BACKPLAN_CHECK_MEMORY's counting allocator, second call, plus the arrays passed
in), the FLOPs recomputing adds, and the step time (median of interleaved rounds, each plan
stepping its own parameters). Each plan's parameters after one step are checked against the
default plan's first.

    python -m backplan.bench.memory_budget_train [--rounds 7] [--models mlp_deep] [--threads 1]
"""

from __future__ import annotations

import argparse

import numpy as np

import backplan as bp
from backplan.bench.internals import checked_memory, count_held, measure

from .affinity import pin_process
from .budget_models import FRACTIONS, MODEL_MAKERS
from .environment import cpu_name
from .measure import interleaved_medians


def train_step(fn, opt, **budget):
    """The README's training step around fn(params, *batch), compiled in its first call
    (no background build: every timed call runs the compiled driver)."""

    @bp.compile(donate_argnums=(0, 1), background=False, **budget)
    def step(params, state, *batch):
        loss, grads = bp.value_and_grad(fn)(params, *batch)
        params, state = opt.update(grads, state, params)
        return params, state, loss

    return step


def fresh(params):
    """Tensors of copies (any pytree): a donated step consumes the buffers it is given."""
    return bp.tree.map(lambda a: bp.tensor(np.array(a)), params)


def variants(fn, opt, params, batch) -> dict:
    """{label: step function}: the default plan and one per fraction of its saved bytes."""
    p = fresh(params)
    planner = train_step(fn, opt).trace(p, opt.init(p), *batch).planner
    held = planner.choices.schedule.held_bytes()
    steps = {"default": (lambda: train_step(fn, opt), held)}
    limits = {f"saved <= 1/{round(1 / f)}": int(held * f) for f in FRACTIONS[1:]}
    fewest = planner.saved_chain(planner.build())[-1].saved  # a lower budget: a higher peak
    limits[f"saved <= {fewest:,} (the fewest at no higher peak)"] = fewest
    for label, limit in limits.items():
        if limit < fewest:
            print(f"{label}: refused (saved_bytes_budget never gives a higher peak)")
            continue
        steps[label] = (lambda limit=limit: train_step(fn, opt, saved_bytes_budget=limit), limit)
    return steps


def plan_facts(make, opt, params, batch) -> dict:
    """Saved bytes, predicted and measured peaks, added FLOPs of one variant's plan."""
    step = make()
    p = fresh(params)
    state = opt.init(p)
    report = step.explain(p, state, *batch)
    planner = step.trace(p, state, *batch).planner
    chosen = planner.recomputed_for
    saved = chosen[1].held_bytes if chosen else planner.choices.schedule.held_bytes()
    flops = chosen[1].added_flops if chosen else 0
    with checked_memory():
        checked = make()
        p, state, loss = checked(p, state, *batch)
        with measure() as measured:
            count_held([loss.numpy()])  # the loop users write: the last loss bound meanwhile
            checked(p, state, *batch)
    return dict(
        saved=saved,
        peak=report.peak_bytes,
        measured=measured.peak + report.peak.input_bytes,
        flops=100 * flops / max(planner.step_flops(), 1),
    )


def first_steps(steps: dict, opt, params, batch) -> dict:
    """{label: (step, [params, state])} after one call each, refusing a plan whose updated
    parameters differ from the default plan's beyond float reassociation."""
    done, first = {}, None
    for label, step in steps.items():
        p = fresh(params)
        p, state, _ = step(p, opt.init(p), *batch)
        leaves = [np.asarray(a) for a in bp.tree.leaves(p)]
        if first is None:
            first = leaves
        elif not all(
            np.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(first, leaves, strict=True)
        ):
            raise RuntimeError(f"{label}: the budgeted step's parameters differ")
        done[label] = (step, [p, state])
    return done


def time_steps(running: dict, batch, rounds: int) -> dict:
    """{label: median ms per step}, rounds interleaved, each plan stepping its own state."""

    def stepping(step, held):
        def run():
            held[0], held[1], _ = step(held[0], held[1], *batch)

        return run

    steps = {label: stepping(step, held) for label, (step, held) in running.items()}
    return interleaved_medians(steps, rounds, 0.0, count=1)


def budget_rows(fn, params, batch, rounds: int) -> dict:
    """{label: facts of its plan (plan_facts) and its median step ms}."""
    batch = [bp.tensor(a) for a in batch]
    opt = bp.optim.adam(1e-3)
    made = variants(fn, opt, params, batch)
    facts = {label: plan_facts(make, opt, params, batch) for label, (make, _) in made.items()}
    running = first_steps({label: make() for label, (make, _) in made.items()}, opt, params, batch)
    times = time_steps(running, batch, rounds)
    return {label: dict(facts[label], ms=times[label]) for label in facts}


def model_rows(name: str, rounds: int) -> None:
    rows = budget_rows(*MODEL_MAKERS[name](), rounds)
    base = rows["default"]["ms"]
    for label, f in rows.items():
        print(
            f"{name} train {label}: saved {f['saved']:,} B, peak {f['peak']:,} B (measured "
            f"{f['measured']:,} B), +{f['flops']:.1f}% FLOPs, step {f['ms']:.2f} ms "
            f"({f['ms'] / base:.2f}x)"
        )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--models", default="mlp_deep")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    print(f"CPU: {cpu_name()}; {pin_process(args.threads)['affinity']}")
    for name in args.models.split(","):
        model_rows(name, args.rounds)


if __name__ == "__main__":
    main()
