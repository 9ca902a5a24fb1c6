"""What a plan's first call that compiles leaves alive, and what collecting it costs.

Each row is a fresh process with an empty kernel cache folder (the library's machine code from
BACKPLAN_LIBRARY_CACHE_DIR, or compiled there too): a two-head attention value_and_grad's first
call compiles its plan; the result is dropped and the rows say how many of its arrays are still
alive with no collection having run (the collector is off in the child), the first call's CPU
seconds and the CPU seconds of the collection the first call runs (codegen/run/
compile_garbage.py). `--peers` imports PyTorch and JAX first (their long-lived objects are what
the collection walks beside the compile's); `--without` turns the collection off, as before it.

    python -m backplan.bench.compile_garbage [--peers] [--without] [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import gc, json, sys, time, weakref
if PEERS:
    import torch, jax  # noqa: F401
gc.disable()
import numpy as np
import backplan as bp
from backplan.bench.internals import compile_garbage

spent = []
collect = compile_garbage.collect_if_compiled
def timed(before):
    start = time.process_time()
    ran = collect(before) if not WITHOUT else False
    spent.append(time.process_time() - start)
    return ran
compile_garbage.collect_if_compiled = timed

def loss(wq, wk, x):
    def heads(t):
        return t.reshape(2, 5, 2, 3).transpose(0, 2, 1, 3)
    q, k = heads(x @ wq), heads(x @ wk)
    mixed = bp.softmax((q @ k.swapaxes(-1, -2)) * 0.5, axis=-1) @ q
    return bp.sum(mixed.transpose(0, 2, 1, 3).reshape(2, 5, 6) ** 2)

rng = np.random.default_rng(0)
wq, wk = (rng.standard_normal((6, 6)).astype(np.float32) for _ in range(2))
x = rng.standard_normal((2, 5, 6)).astype(np.float32)
step = bp.value_and_grad(loss, argnums=(0, 1))
start = time.process_time()
value, grads = step(wq, wk, x)
first = time.process_time() - start
def buffer(a):
    while a.base is not None:
        a = a.base
    return a
alive = [weakref.ref(buffer(t.numpy())) for t in (value, *grads)]
del value, grads
print(json.dumps({
    "first_call_cpu_s": first,
    "collect_cpu_s": sum(spent),
    "alive_after_del": sum(r() is not None for r in alive),
    "results": len(alive),
    "tracked_objects": len(gc.get_objects()),
}))
"""


def child(peers: bool, without: bool) -> dict:
    code = f"PEERS = {peers!r}\nWITHOUT = {without!r}\n" + CHILD
    with tempfile.TemporaryDirectory() as folder:
        env = dict(os.environ, BACKPLAN_CACHE_DIR=folder, BACKPLAN_DRIVER="inline")
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
        )
    if out.returncode:
        raise RuntimeError(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backplan.bench.compile_garbage")
    parser.add_argument("--peers", action="store_true")
    parser.add_argument("--without", action="store_true")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args(argv)
    for _ in range(args.rounds):
        print(json.dumps(child(args.peers, args.without)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
