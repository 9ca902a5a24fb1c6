"""Does explain print what the process reaches? For each bench model's step at its small size
(`vg`: bp.value_and_grad(loss); `train`: the step users write, value_and_grad and adam's update
in one bp.compile(donate_argnums=(0, 1))) and the README's training step, three readings of
the same step, side by side:

- printed: the number on every `peak:` line of `print(step.explain(...))` (they must agree),
  its bytes per category at the peak, and the saved bytes section 3 lists (your arrays apart);
- accounted: ir/peak.py over the plans the step runs (the planner's own count) and, for the
  saved bytes, the plan's held bytes as the memory frontier counts them;
- measured: the checked mode (BACKPLAN_CHECK_MEMORY=1), every buffer the compiled calls
  allocate or use through one counting allocator, the peak of their sum on a second call, per
  buffer name (scratch arenas, outputs by position) mapped to explain's categories.

    python -m backplan.bench.memory_audit [--models mlp_tiny,cnn] [--steps vg,train] [--readme]

A mismatch is printed on the row (`MISMATCH: ...`) and the exit status is 1. The fresh-process
check (peak resident memory growth, >= 64 MiB) is bench/memory.py; `--fresh MODEL:SCALE` runs
it here too and compares its growth with the printed peak less the arrays passed in and the
constants (issue 30: within 5% + 8 MiB).
"""

from __future__ import annotations

import argparse
import re
import sys

import numpy as np

import backplan as bp
from backplan.bench.internals import checked_memory, count_held, measure
from backplan.bench.models import MODELS
from backplan.bench.peers.backplan_peer import bench_function

PEAK_LINE = re.compile(r"peak: ([\d,]+) B")


def model_step(name: str, kind: str):
    """(step, its arguments as a list of pytrees, the number of non-gradient outputs of a
    joint plan or None) for a bench model at its small size."""
    spec = MODELS[name]
    inputs = spec.inputs(small=True, dtype=np.float32)
    params = {k: bp.tensor(v) for k, v in inputs.params.items()}
    batch = [bp.tensor(a) for a in inputs.batch(True)]
    loss = bench_function(spec)
    if kind == "vg":
        return bp.value_and_grad(loss), [params, *batch], 1
    opt = bp.optim.adam(1e-3)

    @bp.compile(donate_argnums=(0, 1))
    def train_step(params, state, *batch):
        value, grads = bp.value_and_grad(loss)(params, *batch)
        params, state = opt.update(grads, state, params)
        return params, state, value

    return train_step, [params, opt.init(params), *batch], None


def readme_step():
    """The README's training step (two layers, clip + adamw, donated), batch 64."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 16)).astype(np.float32)
    y = (x @ rng.standard_normal((16, 1)) > 0).astype(np.float32)
    params = {
        "w1": bp.tensor(rng.standard_normal((16, 32)).astype(np.float32) * 0.25),
        "b1": bp.tensor(np.zeros(32, np.float32)),
        "w2": bp.tensor(rng.standard_normal((32, 1)).astype(np.float32) * 0.25),
    }

    def loss_fn(params, x, y):
        logits = bp.relu(x @ params["w1"] + params["b1"]) @ params["w2"]
        softplus = bp.log(1.0 + bp.exp(-bp.abs(logits)))
        return bp.mean(bp.maximum(logits, 0.0) - logits * y + softplus)

    opt = bp.optim.chain(bp.optim.clip_by_global_norm(1.0), bp.optim.adamw(1e-2))

    @bp.compile(donate_argnums=(0, 1))
    def train_step(params, state, x, y, loss_weight):
        loss, grads = bp.value_and_grad(lambda p: loss_fn(p, x, y) * loss_weight)(params)
        params, state = opt.update(grads, state, params)
        return params, state, loss

    return train_step, [params, opt.init(params), x, y, 1.0], None


def printed_facts(step, args) -> dict:
    """What explain prints: the peak (every `peak:` line), categories at the peak, saved."""
    report = step.explain(*args)
    peaks = {int(p.replace(",", "")) for p in PEAK_LINE.findall(str(report))}
    saved = report.saved_bytes - report.saved_input_bytes
    saved += report.inner_saved_bytes - report.inner_saved_input_bytes
    frontier = report.frontier
    return dict(
        report=report,
        printed=peaks,
        categories=report.peak.at_peak(),
        saved=saved,
        accounted_saved=frontier.points[0].saved_bytes if frontier else None,
    )


def measured_facts(make, n_outputs) -> dict:
    """The checked mode's peak on a second call of a fresh step in the loop users write (the
    first call's results bound until the second returns: what peak_bytes counts), and its
    buffers by category (a joint plan's outputs: the values first, then gradients)."""
    with checked_memory():
        step, held, _ = make()  # the only reference: a donated argument must be given up

        def call():
            result = step(*held)
            if n_outputs is None:  # a donating training step: feed its outputs back
                held[0], held[1] = result[0], result[1]
                return result[2:]  # the loss: what the loop keeps besides
            return result

        last = call()
        with measure() as measured:
            count_held([leaf.numpy() for leaf in bp.tree.leaves(last)])
            last = call()  # the old results go once the call has returned
        del last
    categories: dict[str, int] = {}
    for name, nbytes in measured.at_peak.items():
        category = name
        if name.startswith("output"):
            position = int(name.split()[1])
            joint = n_outputs is not None
            category = "gradients" if joint and position >= n_outputs else "outputs"
        categories[category] = categories.get(category, 0) + nbytes
    return dict(peak=measured.peak, categories=categories)


def audit(label: str, make) -> tuple[str, list[str]]:
    """One table row and the mismatches found."""
    step, args, n_outputs = make()
    facts = printed_facts(step, args)
    report = facts["report"]
    measured = measured_facts(make, n_outputs)
    problems = []
    if len(facts["printed"]) != 1:
        problems.append(f"peak lines disagree: {sorted(facts['printed'])}")
    printed = max(facts["printed"], default=0)
    if printed != report.peak_bytes:
        problems.append(f"printed {printed:,} != report.peak_bytes {report.peak_bytes:,}")
    allocated = report.peak.allocated_peak_bytes
    if measured["peak"] != allocated:
        problems.append(f"checked mode {measured['peak']:,} != predicted {allocated:,}")
    unseen = ("inputs", "donated")  # yours, passed in
    mine = {c: n for c, n in facts["categories"].items() if c not in unseen}
    if report.peak.backend == "numba" and mine != measured["categories"]:  # the reference
        # interpreter names each buffer by its node, not by category
        problems.append(f"categories {mine} != measured {measured['categories']}")
    if facts["accounted_saved"] is not None and facts["saved"] != facts["accounted_saved"]:
        problems.append(f"saved {facts['saved']:,} != held {facts['accounted_saved']:,}")
    cells = ", ".join(f"{c} {n:,}" for c, n in facts["categories"].items())
    row = (
        f"| {label} | {printed:,} | {report.peak.input_bytes:,} | {allocated:,} | "
        f"{measured['peak']:,} | {cells} | {facts['saved']:,} | "
        f"{facts['accounted_saved'] if facts['accounted_saved'] is not None else '-':,} | "
        f"{'; '.join(problems) or 'equal'} |"
    )
    return row, problems


def fresh_row(name: str, scale: int, kind: str) -> tuple[str, list[str]]:
    """bench/memory.py's fresh-process growth against the printed peak less the arrays passed
    in and the constants: within 5% + 8 MiB."""
    from backplan.bench.memory import _step
    from backplan.bench.memory import measure as fresh_measure

    found = fresh_measure(name, scale, kind)
    step, args = _step(name, scale, kind)
    report = step.explain(*args)
    # the first step holds no earlier results: one call's peak (report.call_peak_bytes)
    printed = report.call_peak_bytes
    resident = report.call_peak.input_bytes + report.call_peak.at_peak().get("constants", 0)
    expected = printed - resident
    problems = []
    for where, run in (("fresh", found), ("primed", found["primed"])):
        if not run["driver_loaded_before"]:
            problems.append(f"{where}: the driver compiled inside the step")
    for where, growth in (
        ("fresh", found["measured_growth"]),
        ("primed", found["primed"]["measured_growth"]),
    ):
        if abs(growth - expected) > 0.05 * expected + 8 * 2**20:
            problems.append(f"{where} growth {growth:,} outside {expected:,} +- 5% + 8 MiB")
    row = (
        f"| {name} {kind} x{scale} | {printed:,} | {resident:,} | {expected:,} | "
        f"{found['measured_growth']:,} ({100 * (found['measured_growth'] / expected - 1):+.1f}%) | "
        f"{found['primed']['measured_growth']:,} "
        f"({100 * (found['primed']['measured_growth'] / expected - 1):+.1f}%) | "
        f"{'; '.join(problems) or 'within'} |"
    )
    return row, problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backplan.bench.memory_audit")
    trainable = ",".join(n for n, spec in MODELS.items() if spec.train)
    parser.add_argument("--models", default=trainable)
    parser.add_argument("--steps", default="vg,train")
    parser.add_argument("--readme", action="store_true", help="the README's training step too")
    parser.add_argument("--fresh", default="", help="MODEL:SCALE[:STEP],... fresh-process rows")
    args = parser.parse_args(argv)
    bad = []
    print(
        "| step | printed peak | arrays passed in | predicted allocated | checked mode measured "
        "| printed categories at the peak | printed saved | held (frontier) | verdict |"
    )
    print("|" + " --- |" * 9)
    cases = [
        (f"{name} {kind}", lambda name=name, kind=kind: model_step(name, kind))
        for name in args.models.split(",")
        if name
        for kind in args.steps.split(",")
    ]
    if args.readme:
        cases.append(("README train_step", readme_step))
    for label, make in cases:
        row, problems = audit(label, make)
        bad += problems
        print(row, flush=True)
    if args.fresh:
        print(
            "\n| step | printed peak | arrays passed in + constants | expected growth | fresh "
            "process growth | primed process growth | verdict |"
        )
        print("|" + " --- |" * 7)
        for spec in args.fresh.split(","):
            name, scale, *kind = spec.split(":")
            row, problems = fresh_row(name, int(scale), kind[0] if kind else "vg")
            bad += problems
            print(row, flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
