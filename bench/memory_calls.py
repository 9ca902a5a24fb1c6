"""Does every call of a step hold what explain prints for that call? Calls 1..N of each step are
counted by the checked mode (BACKPLAN_CHECK_MEMORY's counting allocator) in one measurement
open across the calls, so what earlier calls left alive (the arenas of plans compiled then and
not run now) counts too, against `report.peak_on_call(n)`: a small compiled loss that
backward() follows runs two plans on calls 1-2 and one joint plan from call 3
(runtime/joint_step.py).

Steps, each bench model at its small size: `compile` (loss = bp.compile(f)(...);
loss.backward()), `vg` (bp.value_and_grad(f)), `train` (value_and_grad and adam's update in
one bp.compile(donate_argnums=(0, 1))); `--readme` adds the README's training step. Each call
drops the last call's results first, against `report.peak_on_call(n)`; with `--loop` the loop
users write keeps them bound until the next call returns (`loss, grads = step(...)`), against
`report.loop_peak_on_call(n)`.

    python -m backplan.bench.memory_calls [--models mlp_tiny,cnn] [--steps compile,vg,train]
        [--calls 5] [--readme] [--backend numba] [--loop] [--dtype bfloat16]

--dtype float16 / bfloat16: the models' float arrays in that dtype (compile and vg steps): on the
reference backend the interpreter runs such a plan widened, float32 values held until the op
rounding them, and that is the plan explain counts.

A call whose count differs from its printed peak makes the exit status 1.
"""

from __future__ import annotations

import argparse
import sys

import ml_dtypes
import numpy as np

import backplan as bp
from backplan.bench.internals import checked_memory, measure, use_backend
from backplan.bench.models import MODELS
from backplan.bench.peers.backplan_peer import bench_function

from .memory_audit import model_step as audited_step
from .memory_audit import readme_step as audited_readme_step


def counted_calls(step, calls: int) -> list[int]:
    """The most bytes of the step's own buffers held during each of `calls` calls: from the
    call's first allocation, so what earlier calls left alive counts while it is still held
    then (a joint plan taking over frees the two plans' arenas first)."""
    counted = []
    with measure() as measured:
        for _ in range(calls):
            measured.restart_at_next_use()  # what is freed before the call allocates goes
            step()
            counted.append(measured.peak)
    return counted


def printed_calls(report, calls: int, loop: bool = False) -> list[int]:
    """What explain prints each call holds of its own buffers (the arrays passed in apart);
    loop: in a loop that keeps the last results until the call returns."""
    peak_on_call = report.loop_peak_on_call if loop else report.peak_on_call
    return [peak_on_call(n).allocated_peak_bytes for n in range(1, calls + 1)]


DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def model_arrays(name: str, requires_grad: bool = False, dtype: str = "float32"):
    """(params, batch) of a bench model at its small size, as tensors, float arrays in dtype."""
    inputs = MODELS[name].inputs(small=True, dtype=np.float32)
    cast = DTYPES[dtype]
    params = {
        k: bp.tensor(v.astype(cast), requires_grad=requires_grad) for k, v in inputs.params.items()
    }
    return params, [
        bp.tensor(a.astype(cast) if a.dtype.kind == "f" else a) for a in inputs.batch(True)
    ]


def compile_step(name: str, keep: bool = False, dtype: str = "float32"):
    """(step, report): loss = bp.compile(f)(params, *batch); loss.backward(). keep: the loss
    stays bound until the next call's forward returns, as `loss = f(...)` in a loop."""
    params, batch = model_arrays(name, requires_grad=True, dtype=dtype)
    loss = bp.compile(bench_function(MODELS[name]))
    report = bp.explain(loss, params, *batch)
    held = [None]

    def step():
        bp.zero_grad(params)  # the last call's gradients go before this call allocates
        value = loss(params, *batch)
        held[0] = value if keep else None
        value.backward()

    return step, report


def vg_step(name: str, keep: bool = False, dtype: str = "float32"):
    """(step, report): bp.value_and_grad(f)(params, *batch); keep: its results stay bound
    until the next call returns, as `loss, grads = step(...)` in a loop."""
    params, batch = model_arrays(name, dtype=dtype)
    fn = bp.value_and_grad(bench_function(MODELS[name]))
    held = [None]

    def step():
        result = fn(params, *batch)  # the last results, if kept, are held until it returns
        held[0] = result if keep else None

    return step, bp.explain(fn, params, *batch)


def donated_calls(train_step, args: list, keep: bool = False):
    """(step, report) of a training step donating its first two arguments (parameters and
    optimizer state) and returning their new values first. Each call passes fresh copies of
    the last call's: the caller's arrays, as a first call's (on the reference interpreter a
    call allocates what it returns, and the measurement would go on counting it). keep: the
    results that are not passed back in (the loss) stay bound until the next call returns."""
    held = list(args)
    report = bp.explain(train_step, *held)
    rest = [None]

    def step():
        fresh = bp.tree.map(lambda t: bp.tensor(t.numpy().copy()), (held[0], held[1]))
        held[0] = held[1] = None
        result = train_step(*fresh, *held[2:])
        held[0], held[1] = result[0], result[1]
        rest[0] = result[2:] if keep else None

    return step, report


def train_step(name: str, keep: bool = False, dtype: str = "float32"):
    """value_and_grad and adam's update in one bp.compile(donate_argnums=(0, 1))."""
    if dtype != "float32":
        raise SystemExit("--dtype other than float32: the compile and vg steps only")
    step, args, _ = audited_step(name, "train")
    return donated_calls(step, args, keep)


def readme_step(keep: bool = False):
    """The README's training step as it is written (bench.memory_audit's)."""
    step, args, _ = audited_readme_step()
    return donated_calls(step, args, keep)


STEPS = {"compile": compile_step, "vg": vg_step, "train": train_step}


def row(label: str, make, calls: int, loop: bool = False) -> tuple[str, bool]:
    """One table row (printed and counted per call) and whether they are equal."""
    with checked_memory():
        step, report = make()
        counted = counted_calls(step, calls)
    printed = printed_calls(report, calls, loop)
    runs = "; ".join(f"from call {c.first_call}: {c.runs}" for c in report.call_peaks)
    same = counted == printed
    cells = " | ".join(
        f"{p:,}" if p == c else f"{p:,} printed, {c:,} counted"
        for p, c in zip(printed, counted, strict=True)
    )
    return f"| {label} | {runs} | {cells} | {'equal' if same else 'MISMATCH'} |", same


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backplan.bench.memory_calls")
    trainable = ",".join(n for n, spec in MODELS.items() if spec.train)
    parser.add_argument("--models", default=trainable)
    parser.add_argument("--steps", default="compile,vg,train")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--readme", action="store_true", help="the README's training step too")
    parser.add_argument("--backend", default="numba", choices=("numba", "reference"))
    parser.add_argument(
        "--loop", action="store_true", help="keep the last results until the next call returns"
    )
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    args = parser.parse_args(argv)
    cases = [
        (f"{name} {kind}", lambda name=name, kind=kind: STEPS[kind](name, args.loop, args.dtype))
        for name in args.models.split(",")
        if name
        for kind in args.steps.split(",")
    ]
    if args.readme:
        cases.append(("README train_step", lambda: readme_step(args.loop)))
    calls = " | ".join(f"call {n}" for n in range(1, args.calls + 1))
    print(f"| step ({args.backend}) | plans by call | {calls} | verdict |")
    print("|" + " --- |" * (args.calls + 3))
    ok = True
    with use_backend(args.backend):
        for label, make in cases:
            text, same = row(label, make, args.calls, args.loop)
            ok = ok and same
            print(text, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
