"""Budgets between two rows of memory_frontier, on the current backend: for each gap between
consecutive rows, budgets at 1/4, 1/2 and 3/4 of it; per budget the peak explain prints for the
plan the budget runs and the FLOPs it adds, against the next row (what a budget would run if
nothing between rows were found). The plan run must fit; fewer added FLOPs than the row is
the point of looking between rows.

    python -m backplan.bench.budget_between_rows [--models transformer,mlp_deep,chain60]
"""

from __future__ import annotations

import argparse

import backplan as bp
from backplan.bench.internals import current_backend, node_flops

from .budget_models import MODEL_MAKERS, deep_chain
from .environment import cpu_name

FRACTIONS = (0.25, 0.5, 0.75)


def _model(name: str):
    if name.startswith("chain"):
        return deep_chain(int(name[len("chain") :]))
    return MODEL_MAKERS[name]()


def _plan_flops(fn, args) -> int:
    """FLOPs of the joint plan fn runs for args."""
    return sum(node_flops(n) for n in fn.trace(*args).plan.graph.nodes)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="transformer,mlp_deep,chain60")
    args = parser.parse_args(argv)
    print(f"CPU: {cpu_name()}; backend: {current_backend()}")
    for name in args.models.split(","):
        fn, params, batch = _model(name)
        default = bp.value_and_grad(fn)
        rows = default.memory_frontier(params, *batch).points
        base = _plan_flops(default, (params, *batch))
        fewer = total = 0
        saved = 0
        for above, below in zip(rows, rows[1:], strict=False):
            for fraction in FRACTIONS:
                budget = int(below.peak_bytes + fraction * (above.peak_bytes - below.peak_bytes))
                step = bp.value_and_grad(fn, max_peak_bytes=budget)
                report = bp.explain(step, params, *batch)
                added = _plan_flops(step, (params, *batch)) - base
                assert report.peak_bytes <= budget, (name, budget, report.peak_bytes)
                total += 1
                fewer += added < below.added_flops
                saved += below.added_flops - added
                print(
                    f"{name}: budget {budget:,} B: runs a plan peaking at {report.peak_bytes:,} B "
                    f"adding {added:,} FLOPs (the next row: {below.peak_bytes:,} B, "
                    f"{below.added_flops:,})"
                )
        print(
            f"{name}: {len(rows)} rows; {fewer} of {total} budgets between rows ran a plan adding "
            f"fewer FLOPs than the next row ({saved:,} FLOPs fewer in all)"
        )


if __name__ == "__main__":
    main()
