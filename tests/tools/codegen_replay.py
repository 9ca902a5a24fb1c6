"""Process replay for code generation: every op sample and every bench model lowered and
rendered to Numba source, written as JSON, so two revisions can be diffed byte for byte.

    python tests/tools/codegen_replay.py write before.json   # on the old revision
    python tests/tools/codegen_replay.py write after.json    # on the new one
    python tests/tools/codegen_replay.py compare before.json after.json

Nothing is compiled: only source is generated. Ops added since the old revision are left
out of the new one with REPLAY_SKIP_OPS=sin,cos so both revisions batch the same samples.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def op_sample_plans():
    from op_samples import SAMPLES
    from test_codegen import batch_graph

    from backplan.ir.pipeline import build_joint_plan, build_region_plans
    from backplan.ir.registry import all_ops

    ops = set(all_ops()) - set(os.environ.get("REPLAY_SKIP_OPS", "").split(","))
    for dtype in ("f32", "f64"):
        chosen = [s for s in SAMPLES if dtype in s.dtypes and s.op in ops]
        for start in range(0, len(chosen), 12):
            samples = chosen[start : start + 12]
            name = f"ops_{dtype}_{start // 12}"
            graph, _, wrt = batch_graph(samples, dtype)
            yield f"{name}.joint", build_joint_plan(graph, wrt), ()
            graph, _, wrt = batch_graph(samples, dtype)
            plans = build_region_plans(graph, wrt)
            yield from region_variants(name, plans)
            for sample in samples:
                try:
                    graph, _, wrt = batch_graph([sample], dtype)
                except IndexError:
                    continue  # no float output: nothing to differentiate alone
                yield f"{name}.{sample.id}.joint", build_joint_plan(graph, wrt), ()


def region_variants(name, plans):
    from backplan.runtime.program import RegionProgram

    yield f"{name}.forward", plans.forward, ()
    if plans.backward is not None:
        program = RegionProgram(plans, name)
        yield f"{name}.retain", plans.backward, ()
        yield f"{name}.consume", plans.backward, program.private_saved_inputs()


def bench_model_plans():
    import backplan as bp
    from backplan.bench.models import MODELS
    from backplan.bench.peers.backplan_peer import _tensors, bench_function

    for spec in MODELS.values():
        for small in (False, True):
            inputs = spec.inputs(small, "float32")
            name = f"{spec.name}.{'small' if small else 'full'}"
            params, batch = _tensors(spec, inputs, requires_grad=spec.train)
            traced = bp.compile(bench_function(spec)).trace(params, *batch)
            yield from region_variants(name, traced.program.plans)
            if spec.train:
                params, batch = _tensors(spec, inputs, requires_grad=False)
                joint = bp.value_and_grad(bench_function(spec)).trace(params, *batch)
                yield f"{name}.joint", joint.plan, ()


def sources() -> dict[str, str]:
    from backplan.codegen.render.emit import generate
    from backplan.codegen.render.opaque import Unsupported

    try:
        from backplan.ir.lowering import lower
    except ImportError:  # a revision before the lowering step: generate took the plan

        def lower(plan, private):
            return plan, private

    out = {}
    for producer in (op_sample_plans, bench_model_plans):
        for name, plan, private in producer():
            try:
                lowered = lower(plan, private)
                args = lowered if isinstance(lowered, tuple) else (lowered,)
                out[name] = generate(*args).source
            except Unsupported as exc:
                out[name] = f"<unsupported: {exc}>"
    return out


def compare(before: dict, after: dict) -> list[str]:
    problems = [f"missing after: {k}" for k in before if k not in after]
    problems += [f"new after: {k}" for k in after if k not in before]
    problems += [f"differs: {k}" for k in before if k in after and before[k] != after[k]]
    return problems


def main(argv: list[str]) -> int:
    if argv[:1] == ["write"] and len(argv) == 2:
        Path(argv[1]).write_text(json.dumps(sources(), indent=1, sort_keys=True))
        return 0
    if argv[:1] == ["compare"] and len(argv) == 3:
        before, after = (json.loads(Path(p).read_text()) for p in argv[1:])
        problems = compare(before, after)
        print("\n".join(problems) or f"{len(before)} sources identical")
        return 1 if problems else 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
