"""Step time and scaling of data-parallel training on the bench mlp and transformer (float32).
A measurement, not a test; run it as

    OPENBLAS_NUM_THREADS=1 NUMBA_NUM_THREADS=1 python -m backplan.bench.data_parallel
    OPENBLAS_NUM_THREADS=1 NUMBA_NUM_THREADS=1 mpiexec -n 2 -bind-to core \\
        python -m backplan.bench.data_parallel --model transformer

Weak scaling, as the scaling efficiency is defined: every rank holds the model's whole batch
(mlp 128 rows, transformer 8 sequences), so N ranks train on N times the rows; efficiency is
the one-rank step time over the N-rank step time (--strong splits one batch instead). Rounds
interleave the timings on every rank: the data-parallel step (its compiled driver starting the
allreduces), the same step with overlap=False (allreduces started after the call), this rank's
value_and_grad alone (compute) and the exchange alone (the same buckets allreduced, no
compute), and the wait after the call of either step (the exposed wait: what the allreduces
still take once the plan has run); rank 0 prints their medians and step - compute, the exchange
as the step sees it (packing, the allreduces, waiting for the slower rank) less what overlaps
compute. It also prints rank 0's CPU time per call (on a machine shared with other work the
wall time stretches by whatever else runs there; the CPU time is what the rank itself did):
the step, the compute, the wait after the call (MPICH spins) and the rest, the step's own work
besides compute and waiting. With several ranks it also times, call by call on every rank, the
plan inside the step (the compiled driver's run) and prints the step against its slower rank:
on a machine shared with other work one rank's core is often taken in turns, so the one-rank
step over the N-rank step (the efficiency) is that rank's slowdown times slower plan / step,
the part the exchange itself costs. With several ranks it prints how much of the allreduces
the step hides behind compute, in wall and CPU time: 1 - (step - compute) / exchange alone,
and where rank 0's CPU time per step goes (cpu_parts_text): the plan inside the step, the
agreement, the bucket waits, averaging and unpacking, and the step's Python.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import backplan as bp
import backplan.distributed as bpd
from backplan.bench.measure import interleaved_medians
from backplan.bench.models import BACKPLAN_KINDS, MODELS

FLOATS = {"f32": bp.float32, "bf16": bp.bfloat16, "f16": bp.float16}  # --dtype


def model_step(name: str, rank: int, size: int, strong: bool, dtype: str = "f32"):
    """(value_and_grad of the model's loss, params, batch) for this rank; dtype: the floats'
    ("bf16", "f16": 16-bit parameters, gradients and buckets)."""
    spec = MODELS[name]
    data = spec.make_inputs(spec.config, seed=0).cast(FLOATS[dtype])
    base = BACKPLAN_KINDS[spec.kind][0]
    loss = (lambda p, *b: base(p, *b, **spec.static)) if spec.static else base
    params = {k: bp.tensor(v, requires_grad=True) for k, v in data.params.items()}
    batch = data.batch(True)
    if strong:
        batch = tuple(bpd.shard(b, rank, size) for b in batch)
    return bp.value_and_grad(loss), params, tuple(bp.tensor(b) for b in batch)


def exchange_alone(step, params, batch):
    """A call that allreduces the step's buckets of this rank's gradients (computed once)."""
    from backplan.distributed.exchange import Exchange
    from backplan.distributed.shared_exchange import SharedExchange

    loss, grads = step.fn(params, *batch)
    arrays = [np.asarray(loss.numpy())] + [g.numpy() for g in bp.tree.leaves(grads)]
    layout = step.layout((params, *batch))
    world = bpd.init()
    kind = SharedExchange if step.reduction(world) == "shared" else Exchange

    def run():
        exchange = kind(world, layout, True)
        exchange.windows = step.windows  # the step's window, not a new one each call
        exchange.start(lambda index: arrays[index])
        exchange.finish()

    return run


def waited(step, params, batch, seconds: list, done: list | None = None, cpu_seconds=None):
    """A step call that records how long it waits for its allreduces after the plan ran (and
    in cpu_seconds the CPU time of that wait), and in `done` how many of the buckets its
    driver started had completed by then."""
    from backplan.distributed.driver_mpi import BUCKET_SLOTS, DONE, HEADER, STATE
    from backplan.distributed.exchange import Exchange

    def run():
        exchange = step.started((params, *batch), {}, Exchange)[0]
        if done is not None:
            inside = [r for _, _, r in exchange.started if hasattr(r, "table")]
            complete = [r.table[HEADER + r.k * BUCKET_SLOTS + STATE] == DONE for r in inside]
            done.append((sum(complete), len(inside)))
        start, cpu = time.perf_counter(), time.thread_time()
        exchange.finish()
        seconds.append(time.perf_counter() - start)
        if cpu_seconds is not None:
            cpu_seconds.append(time.thread_time() - cpu)

    return run


STEP_PARTS = ("agreement", "bucket waits", "finish", "pack", "node sums")  # CPU s per call


class TimedPlan:
    """The step's value_and_grad with the wall and CPU time of each call recorded in `plan`
    ("times"): the plan of a step that sums its buckets after the call (shared_exchange.py)."""

    def __init__(self, fn, plan: dict):
        self._fn, self._plan = fn, plan

    def __getattr__(self, name):
        return getattr(self._fn, name)

    def __call__(self, *args, **kwargs):
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return self._fn(*args, **kwargs)
        finally:
            self._plan["times"] = (time.perf_counter() - wall, time.thread_time() - cpu)


def with_plan_times(step, params, batch, records: list):
    """A step call that records (its wall seconds, the wall and CPU seconds of its plan, the
    compiled driver that starts the buckets; then the CPU seconds of the step, of the agreement
    before the plan, of the waits for the buckets and of the rest of finish()) on this rank;
    slower_rank_text pairs the ranks' records call by call (every rank makes the same calls, in
    the same order), cpu_parts_text says where rank 0's CPU went. A measurement in this process
    only: it wraps InPlanExchange.run, DataParallelStep._agree, TableRequest.Wait and
    Exchange.finish."""
    from backplan.distributed.exchange import Exchange
    from backplan.distributed.in_plan import InPlanExchange, TableRequest
    from backplan.distributed.step import DataParallelStep

    original, plan = InPlanExchange.run, {}

    def run(self, *args):
        wall, cpu = time.perf_counter(), time.thread_time()
        outputs = original(self, *args)
        plan["times"] = (time.perf_counter() - wall, time.thread_time() - cpu)
        return outputs

    def cpu_of(name, function):
        def timed(*args, **kwargs):
            cpu = time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                plan[name] = plan.get(name, 0.0) + time.thread_time() - cpu

        return timed

    InPlanExchange.run = run
    DataParallelStep._agree = cpu_of("agreement", DataParallelStep._agree)
    TableRequest.Wait = cpu_of("bucket waits", TableRequest.Wait)
    Exchange.finish = cpu_of("finish", Exchange.finish)
    if step.reduction(bpd.init()) == "shared":  # the plan runs as the step's fn, then sums
        from backplan.distributed.shared_exchange import (
            PartsSummed,
            SharedExchange,
            SharedRequest,
            WindowOutputs,
        )

        step.fn = TimedPlan(step.fn, plan)  # a call the plan writes into the window: below
        timed_run = TimedPlan(WindowOutputs.run, plan)
        WindowOutputs.run = lambda self, *args: timed_run(self, *args)
        DataParallelStep._agree_start = cpu_of("agreement", DataParallelStep._agree_start)
        DataParallelStep._finish_agreement = cpu_of("agreement", DataParallelStep._finish_agreement)
        SharedRequest.Wait = cpu_of("bucket waits", SharedRequest.Wait)
        PartsSummed.Wait = cpu_of("bucket waits", PartsSummed.Wait)  # the parts' meeting
        SharedExchange._start = cpu_of("pack", SharedExchange._start)
        SharedRequest._sum = cpu_of("node sums", SharedRequest._sum)

    def call():
        plan.clear()
        start, cpu = time.perf_counter(), time.thread_time()
        step(params, *batch)
        wall, cpu = time.perf_counter() - start, time.thread_time() - cpu
        parts = [plan.get(name, 0.0) for name in STEP_PARTS]
        parts[1] -= parts[4]  # the waits beyond the sums done inside them
        parts[2] -= parts[1] + parts[4]  # finish() beyond its waits: averaging and unpacking
        records.append((wall, *plan.get("times", (np.nan, np.nan)), cpu, *parts))

    return call


def cpu_parts_text(records: list, compute_cpu: float) -> str:
    """Where rank 0's CPU time per step call goes (means over its calls, ms, so that the parts
    add up to the step): the plan inside the step against the compute alone (the difference:
    the transfers and sums MPI makes inside the driver's tests, and the caches the ranks share),
    the agreement before the plan, the waits for the buckets after it (MPICH spins while the
    other rank has not sent), averaging and unpacking, and the rest (the step's Python)."""
    columns = np.array([r[3:] for r in records]) * 1e3
    plan = float(np.mean([r[2] for r in records])) * 1e3
    step, agreement, waits, finish, pack, sums = np.mean(columns, axis=0)
    rest = step - plan - agreement - waits - finish - pack - sums
    shared = f" + packing {pack:.2f} + the node's sums {sums:.2f}" if pack or sums else ""
    return (
        f"rank 0's step CPU, where it goes (means of {len(records)} calls): step {step:.2f} ms = "
        f"plan inside the step {plan:.2f} (compute alone {compute_cpu * 1e3:.2f}) + the "
        f"agreement {agreement:.2f} + the bucket waits {waits:.2f}{shared} + averaging and "
        f"unpacking {finish:.2f} + the rest {rest:.2f}"
    )


def slower_rank_text(records: list, comm) -> str | None:
    """Rank 0's report of the step against its slower rank (None on the other ranks): per call,
    the plan of the rank that took longest (on a shared machine, the rank whose core other work
    took turns on) and what the step took beyond it (the agreement before the plan, the buckets
    still in flight, the Python of the exchange); the medians over calls, and each rank's plan
    wall and CPU (wall above CPU: the rank was not running)."""
    everyone = comm.gather(records, root=0)
    if everyone is None:
        return None
    calls = min(len(r) for r in everyone)
    step = np.array([everyone[0][i][0] for i in range(calls)]) * 1e3
    plans = np.array([[r[i][1] for r in everyone] for i in range(calls)]) * 1e3
    cpus = np.array([[r[i][2] for r in everyone] for i in range(calls)]) * 1e3
    slower = plans.max(axis=1)
    each = ", ".join(
        f"rank {r} {np.median(plans[:, r]):.2f} / {np.median(cpus[:, r]):.2f}"
        for r in range(len(everyone))
    )
    return (
        f"the step against its slower rank ({calls} calls): step {np.median(step):.2f} ms, the "
        f"slower rank's plan {np.median(slower):.2f} ms, step - slower plan "
        f"{np.median(step - slower):.2f} ms, slower plan / step {np.median(slower / step):.2f}; "
        f"plan wall / CPU ms per rank: {each}"
    )


def training_steps(
    vg, bucket_bytes, params, batch, parts: dict | None = None, faults: dict | None = None
) -> dict:
    """Calls of the adam training step, unsharded and sharded (ZeRO-1), each from the same
    params, as a training loop makes them: `params, state, loss = step(params, state, *batch)`,
    the returned parameters and state passed to the next call (a step given the same arrays
    every call measures another program: ZeRO-1 then copies this rank's range out of
    parameters that are not the views it returned, and the unsharded update's fresh outputs
    find the last call's free). parts: filled with the ZeRO-1 step's parts (zero_parts) once
    the calls are warm; faults: each step's minor page faults per call (this thread's)."""
    calls = {}
    for name, shard in (("adam", False), ("adam_zero1", True)):
        train = bpd.data_parallel(
            vg, bucket_bytes=bucket_bytes, optimizer=bp.optim.adam(1e-3), shard_optimizer=shard
        )
        held = [params, train.init(params)]
        for _ in range(3):
            held[:2] = train(*held, *batch)[:2]
        train.step.wait_for_driver(held[0], *batch, timeout=600)
        if shard and parts is not None:
            zero_parts(train, parts)
        elif parts is not None:  # the unsharded step's update of every parameter, to compare
            train._update = _timed(parts, "unsharded update", train._update)
        calls[name] = _loop_call(train, held, batch, None if faults is None else faults, name)
    return calls


def _counting_faults(call, counts: list):
    """call, appending the minor page faults of each of its calls (this thread's) to counts."""
    import resource

    def run():
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        call()
        counts.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)

    return run


def _loop_call(train, held: list, batch, faults: dict | None, name: str):
    """One call of the training loop on held = [params, state], which it replaces; counts its
    minor page faults in faults[name] (a list of per-call counts)."""
    import resource

    counts = faults.setdefault(name, []) if faults is not None else None

    def run():
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt if counts is not None else 0
        held[:2] = train(*held, *batch)[:2]
        if counts is not None:
            counts.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)

    return run


ZERO_PARTS = {
    "start": "pack + post the reduce-scatter",
    "finish": "reduce-scatter wait",
    "update": "update of the shares",
    "gather": "all-gather (post, wait)",
}


def zero_parts(train, parts: dict) -> None:
    """Record (wall, CPU) seconds of each part of this ZeRO-1 step's calls in parts[name]: the
    sharded exchange's start, finish and gather, and the compiled update (a measurement in
    this process only: it wraps the class's methods and the step's update)."""
    from backplan.distributed.sharding import ShardedExchange

    for name in ("start", "finish", "gather"):
        setattr(ShardedExchange, name, _timed(parts, name, getattr(ShardedExchange, name)))
    train._update = _timed(parts, "update", train._update)


def _timed(parts: dict, name: str, function):
    """function, recording the (wall, CPU) seconds of each call in parts[name]."""
    samples = parts.setdefault(name, [])

    def run(*args, **kwargs):
        wall, cpu = time.perf_counter(), time.thread_time()
        result = function(*args, **kwargs)
        samples.append((time.perf_counter() - wall, time.thread_time() - cpu))
        return result

    return run


def zero_parts_text(parts: dict) -> str:
    """The parts' medians, wall / CPU ms per call, and the unsharded step's update of every
    parameter beside them (its fresh outputs' page faults show there)."""
    said = []
    for name, text in ZERO_PARTS.items():
        said.append(f"{text} {_medians_text(parts[name])}")
    text = "ZeRO-1 parts, median wall / CPU ms per call: " + ", ".join(said)
    if parts.get("unsharded update"):
        text += f"; the unsharded step's update {_medians_text(parts['unsharded update'])}"
    return text


def _medians_text(samples: list) -> str:
    wall, cpu = (float(np.median([s[i] for s in samples])) * 1e3 for i in (0, 1))
    return f"{wall:.2f} / {cpu:.2f}"


def zero_state_text(vg, bucket_bytes, params, batch) -> str:
    world = bpd.init()
    train = bpd.data_parallel(vg, optimizer=bp.optim.adam(1e-3), shard_optimizer=True)
    mine, whole = train.state_bytes(params, world.size)
    return f"{mine:,} B of {whole:,} B"


def lockstep_medians(calls: dict, rounds: int, repeats: int, cpu: dict | None = None) -> dict:
    """Median seconds per call of each entry, timed in interleaved rounds of a fixed number of
    calls (count=): every rank makes the same calls, so their collectives match. cpu: filled
    with each entry's median CPU seconds per call (this thread's: on a machine shared with
    other work the wall time stretches by whatever else runs, the CPU time does not)."""
    if cpu is not None:
        calls = {name: _cpu_timed(call, cpu.setdefault(name, [])) for name, call in calls.items()}
    medians = interleaved_medians(calls, rounds, 0.0, count=repeats)
    if cpu is not None:
        cpu.update({name: float(np.median(seconds)) for name, seconds in cpu.items()})
    return {name: ms / 1e3 for name, ms in medians.items()}


def _cpu_timed(call, seconds: list):
    def run():
        start = time.thread_time()
        call()
        seconds.append(time.thread_time() - start)

    return run


def cpu_text(cpu: dict, waits: dict, size: int, shared: bool = False) -> str:
    """Rank 0's CPU time per call: the step, the compute alone, and with several ranks the CPU
    time of the wait after the call (MPICH spins while it waits) and what the step does besides
    compute and that wait: the rank's own work for the exchange (the agreement, starting and
    testing the buckets inside the driver, unpacking) and the step's Python. shared: the
    buckets are summed in the node's window, inside that wait (medians of other calls than
    the step's, so the rest can read below 0)."""
    text = f"CPU per call: step {cpu['step'] * 1e3:.2f} ms  compute {cpu['compute'] * 1e3:.2f} ms"
    if size == 1:
        return text
    wait = float(np.median(waits["wait_cpu"]))
    own = cpu["step"] - cpu["compute"] - wait
    said = " (the node's sums in it)" if shared else ""
    return f"{text}  the wait after the call{said} {wait * 1e3:.2f} ms  the rest {own * 1e3:.2f} ms"


def hidden_text(medians: dict, cpu: dict, shared: bool = False) -> str:
    """How much of the allreduces the step hides behind compute: the exchange alone (the same
    buckets allreduced with no compute, both ranks entering together) against what the step
    adds to the compute, step - compute; hidden = 1 - added / exchange alone (1: all of it
    overlapped, 0: none). Wall and CPU time, each from the same interleaved rounds: on a shared
    machine the wall figure includes waiting for the other rank's core, the CPU figure only
    what this rank did (its share of the transfer and the sums, MPICH's spinning, the step's
    own work), so it says what overlap cannot hide on one core per rank. shared: the ranks
    sum in the node's window (shared_exchange.py), where nothing is in flight to hide: the
    sums and the meetings are the computing core's work after its plan, so the line says
    what is exposed instead of a fraction hidden."""
    if shared:
        return (
            "allreduce hidden behind compute: nothing to hide on one node (the window's sums "
            "and meetings are each rank's own core's work after its plan; no transfer runs "
            "beside it); exposed, step - compute: "
            f"wall {(medians['step'] - medians['compute']) * 1e3:.2f} ms, "
            f"CPU {(cpu['step'] - cpu['compute']) * 1e3:.2f} ms; the exchange alone (the "
            f"buckets summed, no compute): wall {medians['exchange'] * 1e3:.2f} ms, CPU "
            f"{cpu['exchange'] * 1e3:.2f} ms. Hiding is measured where buckets travel as "
            "messages: BACKPLAN_DP_REDUCTION=mpi (the path between nodes)"
        )
    said = []
    for name, figures in (("wall", medians), ("CPU", cpu)):
        added = figures["step"] - figures["compute"]
        alone = figures["exchange"]
        said.append(
            f"{name}: exchange alone {alone * 1e3:.2f} ms, step - compute {added * 1e3:.2f} ms, "
            f"hidden {1 - max(added, 0.0) / alone:.0%}"
        )
    return "allreduce hidden behind compute: " + "; ".join(said)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="data-parallel step time and scaling")
    parser.add_argument("--model", choices=("mlp", "transformer"), default="mlp")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-bytes", type=int, default=bpd.DEFAULT_BUCKET_BYTES)
    parser.add_argument("--split-plan", action="store_true", help="cut the plan at buckets")
    parser.add_argument("--strong", action="store_true", help="split one batch over the ranks")
    parser.add_argument(
        "--zero", action="store_true", help="also time adam steps, unsharded and ZeRO-1"
    )
    parser.add_argument(
        "--dtype", choices=("f32", "bf16", "f16"), default="f32", help="the model's floats"
    )
    args = parser.parse_args(argv)
    rank, size = bpd.init()
    vg, params, batch = model_step(args.model, rank, size, args.strong, args.dtype)
    step = bpd.data_parallel(vg, bucket_bytes=args.bucket_bytes, split_plan=args.split_plan)
    after = bpd.data_parallel(vg, bucket_bytes=args.bucket_bytes, overlap=False)
    for _ in range(5):
        step(params, *batch)  # compiles, warms caches
        after(params, *batch)
    step.wait_for_driver(params, *batch, timeout=600)  # built in the background by default
    after.wait_for_driver(params, *batch, timeout=600)  # the plan's own, compiled for it
    bpd.check_replicas(params)
    step_faults: list = []  # minor page faults of each timed step call (this thread's)
    calls = {
        "step": _counting_faults(lambda: step(params, *batch), step_faults),
        "step_after": lambda: after(params, *batch),
        "compute": lambda: vg(params, *batch),
    }
    waits: dict = {"wait": [], "wait_after": [], "wait_cpu": []}
    records: list = []
    if size > 1:
        calls["step_plan"] = with_plan_times(step, params, batch, records)
        calls["exchange"] = exchange_alone(step, params, batch)
        calls["wait"] = waited(
            step, params, batch, waits["wait"], waits.setdefault("done", []), waits["wait_cpu"]
        )
        calls["wait_after"] = waited(after, params, batch, waits["wait_after"])
    parts: dict = {}
    faults: dict = {}
    if args.zero:
        calls.update(training_steps(vg, args.bucket_bytes, params, batch, parts, faults))
    cpu: dict = {}
    medians = lockstep_medians(calls, args.rounds, args.repeats, cpu)
    slower = slower_rank_text(records, bpd.init().comm) if size > 1 else None
    if rank == 0:
        report = step.explain(params, *batch)
        inside = sum(row.calls_in_flight is not None for row in report.buckets)
        exposed = max(medians["step"] - medians["compute"], 0.0)
        alone = ""
        if size > 1:
            wait, wait_after = (float(np.median(waits[k])) * 1e3 for k in ("wait", "wait_after"))
            alone = (
                f"  exchange alone {medians['exchange'] * 1e3:.2f} ms\n"
                f"wait after the call: started inside {wait:.2f} ms, started after "
                f"{wait_after:.2f} ms; buckets started inside and complete when the call "
                f"returned: {sum(d for d, _ in waits['done'])} of "
                f"{sum(n for _, n in waits['done'])}"
            )
        print(
            f"{args.model}  ranks {size}  rows/rank {batch[0].shape[0]}  "
            f"buckets {len(report.buckets)} ({inside} started inside the call)  "
            f"bytes/step {report.bytes_per_step:,}  split_plan {args.split_plan}  "
            f"reduction {step.reduction(bpd.init())}\n"
            f"step {medians['step'] * 1e3:.2f} ms  started after the call "
            f"{medians['step_after'] * 1e3:.2f} ms  compute alone {medians['compute'] * 1e3:.2f} ms"
            f"  step - compute {exposed * 1e3:.2f} ms{alone}"
        )
        print(
            f"{cpu_text(cpu, waits, size, step.reduction(bpd.init()) == 'shared')}  minor page "
            f"faults per step call {np.mean(step_faults):.1f}"
        )
        if size > 1:
            print(hidden_text(medians, cpu, step.reduction(bpd.init()) == "shared"))
        if slower:
            print(slower)
            print(cpu_parts_text(records, cpu["compute"]))
        if args.zero:
            print(
                f"adam step in a training loop (params and state passed on): unsharded "
                f"{medians['adam'] * 1e3:.2f} ms  ZeRO-1 {medians['adam_zero1'] * 1e3:.2f} ms  "
                f"(optimizer state per rank: "
                f"{zero_state_text(vg, args.bucket_bytes, params, batch)}); CPU per call "
                f"{cpu['adam'] * 1e3:.2f} / {cpu['adam_zero1'] * 1e3:.2f} ms (ZeRO-1 / "
                f"unsharded {cpu['adam_zero1'] / cpu['adam']:.3f}); minor page faults per call "
                f"{np.mean(faults['adam']):.0f} / {np.mean(faults['adam_zero1']):.0f}"
            )
            print(zero_parts_text(parts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
