"""Fused attention against the same attention left unfused, PyTorch and JAX: one forward and
backward of sum(softmax(q @ k^T / sqrt(d)) @ v * g) per step, at the bench transformer's
attention shapes by default (batch 8, 4 heads, 128 positions, 64 features, float32).

    python -m backplan.bench.attention --threads 1 --rounds 9 [--shape 8,4,128,64]

backplan runs the hand-written form twice, as the fusion pass leaves it (BACKPLAN_FUSE_ATTENTION=1,
the default: one fused kernel, probabilities recomputed in backward) and unfused (=0: the
scores are written and kept for backward); PyTorch runs F.scaled_dot_product_attention, JAX
the same formula under jit. Every peer's gradients are checked against a float64 NumPy
reference. Rounds are interleaved; the table has the median ms per step, the ratio to fused
backplan and, for backplan, the bytes kept from forward for backward (bp.explain). A last
line times the library's softmax rows (the fused kernel's, and every softmax op's) on the
attention's scores, (batch * heads * length, length) float32 with a causal mask, in Gelem/s;
the last two rate the fused forward and backward kernels against the GEMMs they run on the same
shapes (bench/attention_rates.py).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np

from .affinity import current_affinity, pin_process
from .attention_rates import kernel_rates, rate_lines
from .environment import cpu_name, load_average
from .measure import interleaved_medians, max_relative_error
from .threads import apply_threads, prepare_jax_threads


def backplan_steps(inputs, scale):
    """{name: (step, saved bytes)} for the fused and unfused plans of the same function."""
    import backplan as bp
    from backplan.bench.internals import driver_builder

    def loss(q, k, v, g):
        return bp.sum((bp.softmax((q @ k.swapaxes(-1, -2)) * scale, axis=-1) @ v) * g)

    args = [bp.tensor(x) for x in inputs]
    steps = {}
    for name, fuse in (("backplan fused", "1"), ("backplan unfused", "0")):
        before = os.environ.get("BACKPLAN_FUSE_ATTENTION")
        os.environ["BACKPLAN_FUSE_ATTENTION"] = fuse
        try:
            fn = bp.value_and_grad(bp.compile(loss), argnums=(0, 1, 2))
            saved = bp.explain(fn, *args).saved_bytes
            fn(*args)  # traced while the switch is set
        finally:
            _restore("BACKPLAN_FUSE_ATTENTION", before)

        def step(fn=fn):
            return [d.numpy() for d in fn(*args)[1]]

        steps[name] = (step, saved)
    driver_builder.wait_for_builds()
    return steps


def torch_step(inputs):
    import torch

    q, k, v = (torch.tensor(x, requires_grad=True) for x in inputs[:3])
    g = torch.tensor(inputs[3])

    def step():
        for t in (q, k, v):
            t.grad = None
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        (out * g).sum().backward()
        return [t.grad.numpy() for t in (q, k, v)]

    return step


def jax_step(inputs, scale):
    import jax
    import jax.numpy as jnp

    def loss(q, k, v, g):
        weights = jax.nn.softmax((q @ jnp.swapaxes(k, -1, -2)) * scale, axis=-1)
        return jnp.sum((weights @ v) * g)

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    args = [jnp.asarray(x) for x in inputs]

    def step():
        _, grads = fn(*args)
        return [np.asarray(jax.block_until_ready(d)) for d in grads]

    return step


def softmax_rows_rate(rows: int, length: int, seconds: float) -> float:
    """Gelem/s of the library's softmax rows on (rows, length) float32 causal scores: the
    median of interleaved timed calls (the kernel is already compiled by the steps above)."""
    from backplan.bench.internals import softmax_rows

    rng = np.random.default_rng(1)
    scores = rng.standard_normal((rows, length)).astype(np.float32)
    causal = np.triu(np.ones((length, length), bool), 1)  # key j > query i is masked
    scores[np.tile(causal, (rows // length, 1))] = -np.inf
    out = np.empty_like(scores)
    softmax_rows(scores, out, False)
    medians = interleaved_medians({"rows": lambda: softmax_rows(scores, out, False)}, 3, seconds)
    return scores.size / (medians["rows"] * 1e-3) / 1e9


def reference_grads(inputs, scale):
    from backplan.bench.internals import get_op

    q, k, v, g = (x.astype(np.float64) for x in inputs)
    flat = get_op("attention_grad").reference(q, k, v, g, scale=scale, causal=False)
    return [part.reshape(q.shape) for part in np.split(flat, 3)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--shape", default="8,4,128,64", help="batch,heads,length,features")
    parser.add_argument("--seconds", type=float, default=0.3, help="timed per peer and round")
    parser.add_argument(
        "--tile", type=int, default=None, help="keys per tile of the kernels' rates (the plan's)"
    )
    parser.add_argument(
        "--rates-only", action="store_true", help="only the kernels' rates against their GEMMs"
    )
    args = parser.parse_args(argv)
    batch, heads, length, features = (int(n) for n in args.shape.split(","))
    if args.rates_only:
        return print_rates(args, heads, length, features)
    settings = pin_process(args.threads)
    settings |= prepare_jax_threads(args.threads, True)
    rng = np.random.default_rng(0)
    inputs = [
        rng.standard_normal((batch, heads, length, features)).astype(np.float32) for _ in range(4)
    ]
    scale = 1.0 / math.sqrt(features)
    backplan = backplan_steps(inputs, scale)
    peers = {name: step for name, (step, _) in backplan.items()}
    saved = {name: kept for name, (_, kept) in backplan.items()}
    others = {"torch": lambda: torch_step(inputs), "jax": lambda: jax_step(inputs, scale)}
    for name, make in others.items():
        try:
            peers[name] = make()
        except ImportError:
            print(f"{name}: not installed, skipped")
    settings |= apply_threads(args.threads)
    want = reference_grads(inputs, scale)
    errors = {name: max_relative_error(step(), want) for name, step in peers.items()}
    for step in peers.values():
        step()
    load_before = load_average()
    medians = interleaved_medians(peers, args.rounds, args.seconds)
    print(f"python -m backplan.bench.attention {' '.join(argv or sys.argv[1:])}")
    print(
        f"CPU {cpu_name()}, affinity {current_affinity()}, {args.threads} thread(s); "
        f"load {load_before} -> {load_average()}; {settings}"
    )
    print(f"q, k, v, g: ({batch}, {heads}, {length}, {features}) float32, non-causal")
    print(f"{'peer':18} {'median ms':>10} {'x fused':>8} {'saved KiB':>10} {'max rel err':>12}")
    for name, value in medians.items():
        kept = f"{saved[name] / 1024:.1f}" if name in saved else "-"
        ratio = value / medians["backplan fused"]
        print(f"{name:18} {value:10.2f} {ratio:8.2f} {kept:>10} {errors[name]:12.1e}")
    rate = softmax_rows_rate(batch * heads * length, length, args.seconds)
    print(f"softmax rows ({batch * heads * length} x {length} float32, causal): {rate:.2f} Gelem/s")
    print_rates(args, heads, length, features)
    return 0 if all(e < 1e-3 for e in errors.values()) else 1


def print_rates(args, heads: int, length: int, features: int) -> int:
    """The fused kernels' rates against their GEMMs on one batch element's heads; with --tile,
    sequences longer than the tile run key-tiled (two sweeps in backward: 7 products)."""
    if args.rates_only:
        pin_process(args.threads)
        print(f"CPU {cpu_name()}, affinity {current_affinity()}, load {load_average()}")
    from backplan.bench.internals import attention_kernels

    tile = args.tile or attention_kernels.KEYS
    mode = "key-tiled" if length > tile else "one tile"
    print(
        f"kernels on one batch element ({heads} heads, length {length}, tile {tile}: {mode}), "
        "GFLOP/s of their products:"
    )
    rates = kernel_rates(heads, length, features, args.rounds, args.seconds, tile)
    for line in rate_lines(rates):
        print(f"  {line}")
    return 0


def _restore(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


if __name__ == "__main__":
    sys.exit(main())
