"""Throughput of one compiled function called from 1 and from N Python threads at once.

    python -m backplan.bench.concurrent_calls [--threads 2] [--seconds 3] [--batch 256]

Each thread calls the same `bp.value_and_grad` of a small MLP (serial kernels, BLAS limited
to one thread so the threads are what runs in parallel) for the given time; rounds alternate
between 1 and N threads, and the medians of calls per second are printed. Kernels release the
GIL and every call has its own scratch workspace, so N threads can approach N times one.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import numpy as np

import backplan as bp


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


def calls_per_second(step, args, threads: int, seconds: float) -> float:
    """Total calls per second of `threads` threads each calling step(*args) for `seconds`."""
    counts = [0] * threads
    start = threading.Barrier(threads + 1)

    def worker(i):
        start.wait()
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            step(*args)
            counts[i] += 1

    pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    start.wait()
    began = time.perf_counter()
    for t in pool:
        t.join()
    return sum(counts) / (time.perf_counter() - began)


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
    rates = {1: [], options.threads: []}
    for _ in range(options.rounds):
        for n in rates:
            rates[n].append(calls_per_second(step, args, n, options.seconds))
    one = statistics.median(rates[1])
    many = statistics.median(rates[options.threads])
    print(
        f"1 thread: {one:.0f} calls/s; {options.threads} threads: {many:.0f} calls/s "
        f"({many / one:.2f}x), medians of {options.rounds} rounds of {options.seconds} s"
    )


if __name__ == "__main__":
    main()
