"""Throughput of one compiled function called from 1 and from N Python threads at once.

    python -m backplan.bench.concurrent_calls [--threads 2] [--seconds 3] [--batch 256]

Each thread calls the same `bp.value_and_grad` of a small MLP (serial kernels, BLAS limited
to one thread so the threads are what runs in parallel) in bursts of 20 calls; the harness's
interleaved rounds alternate between 1 and N threads for the given time each, and total calls
per second from the median bursts are printed. Kernels release the
GIL and every call has its own scratch workspace, so N threads can approach N times one.
"""

from __future__ import annotations

import argparse
import threading

import numpy as np

import backplan as bp
from backplan.bench.measure import interleaved_medians


def mlp_loss(params, x, labels):
    hidden = bp.tanh(x @ params["w0"] + params["b0"])
    hidden = bp.tanh(hidden @ params["w1"] + params["b1"])
    return bp.cross_entropy(hidden @ params["w2"], labels)


def make_args(batch: int, rng) -> tuple:
    sizes = [64, 256, 256, 10]
    params = {}
    for i, (n, m) in enumerate(zip(sizes, sizes[1:], strict=False)):
        w = rng.standard_normal((n, m)) / np.sqrt(n)
        params[f"w{i}"] = bp.tensor(w.astype(np.float32), requires_grad=True)
        params[f"b{i}"] = bp.tensor(np.zeros(m, np.float32), requires_grad=True)
    x = bp.tensor(rng.standard_normal((batch, 64)).astype(np.float32))
    return params, x, bp.tensor(rng.integers(0, 10, batch))


class Gang:
    """`threads` threads that each call step(*args) `calls` times per burst(): one sample of
    the harness's timing is one burst, started and ended at barriers so thread start-up is not
    timed; a call that raises ends the burst and burst() raises it. close() ends the threads."""

    def __init__(self, step, args, threads: int, calls: int):
        self.step, self.args, self.calls, self.stopping = step, args, calls, False
        self.error: BaseException | None = None
        self.start, self.end = threading.Barrier(threads + 1), threading.Barrier(threads + 1)
        self.pool = [threading.Thread(target=self._work, daemon=True) for _ in range(threads)]
        for thread in self.pool:
            thread.start()

    def _work(self) -> None:
        while True:
            self.start.wait()
            if self.stopping:
                return
            try:
                for _ in range(self.calls):
                    self.step(*self.args)
            except BaseException as exc:  # noqa: BLE001 - re-raised by burst() in the caller
                self.error = exc
            self.end.wait()

    def burst(self) -> None:
        self.start.wait()
        self.end.wait()
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        self.stopping = True
        self.start.wait()
        for thread in self.pool:
            thread.join()


def calls_per_second(step, args, counts: list[int], seconds: float, rounds: int) -> dict:
    """{threads: total calls per second} for each thread count, from the medians of
    interleaved rounds of bursts (bench/measure.py); a burst is 20 calls per thread."""
    gangs = {n: Gang(step, args, n, calls=20) for n in counts}
    try:
        medians = interleaved_medians({n: g.burst for n, g in gangs.items()}, rounds, seconds)
    finally:
        for gang in gangs.values():
            gang.close()
    return {n: 1e3 * n * gangs[n].calls / medians[n] for n in counts}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    options = parser.parse_args(argv)
    try:
        from threadpoolctl import threadpool_limits

        threadpool_limits(1)
    except ImportError:
        print("threadpoolctl not installed: BLAS keeps its own threads")
    step = bp.value_and_grad(bp.compile(mlp_loss))
    args = make_args(options.batch, np.random.default_rng(0))
    for _ in range(20):
        step(*args)
    rates = calls_per_second(step, args, [1, options.threads], options.seconds, options.rounds)
    one, many = rates[1], rates[options.threads]
    print(
        f"1 thread: {one:.0f} calls/s; {options.threads} threads: {many:.0f} calls/s "
        f"({many / one:.2f}x), medians of {options.rounds} interleaved rounds of "
        f"{options.seconds} s"
    )


if __name__ == "__main__":
    main()
