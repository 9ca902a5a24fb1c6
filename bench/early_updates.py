"""What running each optimizer update right after its gradient (ir/update_order.py) saves on the
training step users write: `bp.compile(step, donate_argnums=(0, 1))` around
`bp.value_and_grad(loss)` and `opt.update`, each model's step traced twice, its updates in the
traced order (BACKPLAN_EARLY_UPDATES=0) and moved (the default), with no budget and with
saved_bytes_budget = 1/3 of what the default plan's inlined gradients read from its forward.
Per plan: the predicted peak (explain, the arrays passed in included), the peak the checked mode
measures (BACKPLAN_CHECK_MEMORY's counting allocator, second call, plus the arrays passed in),
the largest difference of its parameters after two steps from the traced order's, and the step
time (median of interleaved rounds, each plan stepping its own parameters).

    python -m backplan.bench.early_updates [--models readme,mlp_deep,transformer6] [--rounds 7]
        [--optimizer adam|readme] [--no-budget]
"""

from __future__ import annotations

import argparse
import contextlib
import os

import numpy as np

import backplan as bp
from backplan.bench.internals import checked_memory, measure

from .affinity import pin_process
from .budget_models import MODEL_MAKERS
from .environment import cpu_name
from .memory_budget_train import fresh, time_steps, train_step


@contextlib.contextmanager
def updates(early: bool):
    """Steps traced inside trace their updates early (the default) or in the traced order."""
    old = os.environ.get("BACKPLAN_EARLY_UPDATES")
    os.environ["BACKPLAN_EARLY_UPDATES"] = "1" if early else "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["BACKPLAN_EARLY_UPDATES"]
        else:
            os.environ["BACKPLAN_EARLY_UPDATES"] = old


def readme():
    """The README's training step: its loss and data, batch 64."""
    rng = np.random.default_rng(0)
    x_all = rng.standard_normal((1024, 16)).astype(np.float32)
    y_all = (x_all @ rng.standard_normal((16, 1)) > 0).astype(np.float32)
    params = {
        "w1": rng.standard_normal((16, 32)).astype(np.float32) * 0.25,
        "b1": np.zeros(32, np.float32),
        "w2": rng.standard_normal((32, 1)).astype(np.float32) * 0.25,
    }

    def loss_fn(params, x, y):
        logits = bp.relu(x @ params["w1"] + params["b1"]) @ params["w2"]
        return bp.mean(bp.maximum(logits, 0.0) - logits * y + bp.log(1.0 + bp.exp(-bp.abs(logits))))

    batch = rng.integers(0, len(x_all), 64)
    return loss_fn, params, (x_all[batch], y_all[batch])


MAKERS = {"readme": readme, **MODEL_MAKERS}
OPTIMIZERS = {
    "adam": lambda: bp.optim.adam(1e-3),
    "readme": lambda: bp.optim.chain(bp.optim.clip_by_global_norm(1.0), bp.optim.adamw(1e-2)),
}


def variants(fn, opt, params, batch, budgets: bool = True) -> dict:
    """{(budget label, early): a function making that step, traced}: both orders, without and
    with the budget."""
    p = fresh(params)
    with updates(False):
        planner = train_step(fn, opt).trace(p, opt.init(p), *batch).planner
    third = planner.choices.schedule.held_bytes() // 3

    def maker(budget: dict, early: bool):
        def make():
            with updates(early):  # the plans are chosen when the step is traced, here
                step = train_step(fn, opt, **budget)
                p = fresh(params)
                step.trace(p, opt.init(p), *batch)
            return step

        return make

    made = {}
    chosen = (("no budget", {}), ("saved <= 1/3", {"saved_bytes_budget": third}))
    for label, budget in chosen if budgets else chosen[:1]:
        for early in (False, True):
            made[(label, early)] = maker(budget, early)
    return made


def facts(make, opt, params, batch) -> dict:
    """Predicted and measured peak (second call), parameters after two steps."""
    p = fresh(params)
    report = make().explain(p, opt.init(p), *batch)
    with checked_memory():
        step = make()
        p, state, _ = step(p, opt.init(p), *batch)
        with measure() as measured:
            p, state, _ = step(p, state, *batch)
    return dict(
        peak=report.peak_bytes,
        measured=measured.peak + report.peak.input_bytes,
        first=[np.asarray(a) for a in bp.tree.leaves(p)],  # (read after: a view is not donated)
    )


def model_rows(name: str, opt_name: str, rounds: int, budgets: bool = True) -> None:
    fn, params, batch = MAKERS[name]()
    batch = [bp.tensor(a) for a in batch]
    opt = OPTIMIZERS[opt_name]()
    makers = variants(fn, opt, params, batch, budgets)
    found = {key: facts(make, opt, params, batch) for key, make in makers.items()}
    running = {}
    for key, make in makers.items():
        step = make()
        p = fresh(params)
        p, state, _ = step(p, opt.init(p), *batch)
        running[key] = (step, [p, state])
    times = time_steps(running, batch, rounds)
    for (label, early), f in found.items():
        base = found[(label, False)]
        diff = max(
            float(np.max(np.abs(a - b))) for a, b in zip(f["first"], base["first"], strict=True)
        )
        order = "early" if early else "traced"
        print(
            f"| {name} ({opt_name}) | {label} | {order} | {f['peak']:,} | {f['measured']:,} | "
            f"{times[(label, early)]:.2f} | "
            f"{times[(label, early)] / times[(label, False)]:.3f}x | {diff:.1e} |",
            flush=True,
        )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--models", default="readme,mlp_deep")
    parser.add_argument("--optimizer", default="adam", choices=sorted(OPTIMIZERS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-budget", action="store_true", help="only the steps without one")
    args = parser.parse_args(argv)
    print(f"CPU: {cpu_name()}; {pin_process(args.threads)['affinity']}")
    print(
        "| model | budget | updates | peak predicted | peak measured | step (ms) | vs traced "
        "| max param diff |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        model_rows(name, args.optimizer, args.rounds, not args.no_budget)


if __name__ == "__main__":
    main()
