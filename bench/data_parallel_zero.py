"""ZeRO-1 against the unsharded adam step of the bench mlp, both in one process, rounds
interleaved (the order flipped every round), each rank's thread CPU and wall medians per call:
the A/B behind BENCHMARKS 35's "ZeRO-1 within 5% of unsharded" readings.

    OPENBLAS_NUM_THREADS=1 NUMBA_NUM_THREADS=1 OMP_NUM_THREADS=1 \\
        mpiexec -n 2 -bind-to core python -m backplan.bench.data_parallel_zero --rounds 8 \\
        --repeats 5 [--same-arrays]

By default each call is the loop users write, `params, state, loss = step(params, state,
*batch)`, the returned parameters and state passed on; --same-arrays gives every call the same
parameters and first state (the older bench's loop: ZeRO-1 then copies its range out of
parameters that are not its views). `bench.data_parallel --zero` times the first in its table;
this module prints both ranks' ratios and the minor page faults per call, and runs under a
package copy's PYTHONPATH for an A/B of two revisions (`bench.data_parallel_passes --copy`).
The loop holds only the last call's results, as a training loop does: results of older calls
kept alive (a round's first arrays, the warm-up's) make the update write into fresh outputs
and the window take new buffers, 55-111 minor faults a call that were the bench's, not the
step's.
"""

from __future__ import annotations

import argparse
import resource
import time

import numpy as np

STEPS = (("plain", False), ("zero", True))


def round_order(names: list[str], r: int) -> list[str]:
    """The steps in round r: as given in even rounds, reversed in odd ones."""
    return list(names) if r % 2 == 0 else list(names)[::-1]


def rank_line(rank: int, medians: dict) -> str:
    """One rank's medians {step: (cpu ms, wall ms)} and ZeRO-1 / unsharded by CPU."""
    parts = "  ".join(f"{k} cpu {c:.3f} wall {w:.3f}" for k, (c, w) in medians.items())
    return f"rank {rank}: {parts}  zero/plain cpu {medians['zero'][0] / medians['plain'][0]:.3f}"


def main(argv=None) -> int:
    import backplan as bp
    import backplan.distributed as bpd
    from backplan.bench.data_parallel import model_step

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--same-arrays", action="store_true", help="the same params every call")
    args = parser.parse_args(argv)
    rank, size = bpd.init()
    vg, params, batch = model_step("mlp", rank, size, False)
    trains = {}
    for name, shard in STEPS:
        train = bpd.data_parallel(vg, optimizer=bp.optim.adam(1e-3), shard_optimizer=shard)
        trains[name] = held = [train, train.init(params), params]
        for warm in range(7):  # warmed as timed: the loop's own arrays, or the same ones
            if warm == 4:
                train.step.wait_for_driver(params, *batch, timeout=600)
            if args.same_arrays:
                train(held[2], held[1], *batch)
            else:
                held[2], held[1] = train(held[2], held[1], *batch)[:2]
    del held  # the loop below holds only the last call's results (older ones make new buffers)
    comm = bpd.init().comm
    cpu = {name: [] for name in trains}
    wall = {name: [] for name in trains}
    faults = dict.fromkeys(trains, 0)
    for r in range(args.rounds):
        for name in round_order(list(trains), r):
            train, state, p = trains[name]
            trains[name][1:] = [None, None]
            comm.Barrier()
            for _ in range(args.repeats):
                before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
                w, c = time.perf_counter(), time.thread_time()
                if args.same_arrays:
                    train(p, state, *batch)
                else:
                    p, state, _ = train(p, state, *batch)
                cpu[name].append(time.thread_time() - c)
                faults[name] += resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
                wall[name].append(time.perf_counter() - w)
            trains[name][1:] = [state, p]
    medians = {k: (np.median(cpu[k]) * 1e3, np.median(wall[k]) * 1e3) for k in cpu}
    found = comm.gather(medians, root=0)
    if rank == 0:
        print(f"{'same arrays' if args.same_arrays else 'training loop'}, {size} ranks")
        for q, d in enumerate(found):
            print(rank_line(q, d))
        print(
            "minor faults per call",
            {k: v / (args.rounds * args.repeats) for k, v in faults.items()},
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
