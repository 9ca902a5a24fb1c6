"""The largest error of float32 tanh over every float32 input, backplan's against the peers':
what docs/ops.md ("How accurate float32 functions are") quotes.

    python -m backplan.bench.tanh_ulps [--peers numpy,torch,jax] [--stride 1]

Every float32 in [0, 10] (every --stride-th bit pattern), each library's float32 tanh against
float64's np.tanh, in ulps of the correctly rounded result (tests/test_mathlib.py's count):
tanh is odd, and above 10 each of them returns 1. backplan's are the loops its kernels inline:
tanh_f32 (a float32 result) and tanh_rational_f32 (a result a loop only rounds into 16 bits).
Also the share of inputs each does not round correctly. About 2.2e9 tanh calls at stride 1.
"""

from __future__ import annotations

import argparse
import json
import time

import numba
import numpy as np

from backplan.bench.internals import tanh_f32, tanh_rational_f32

CHUNK = 1 << 24


def _loop(fn):
    @numba.njit
    def loop(xs, out):
        for i in range(xs.size):
            out[i] = fn(xs[i])

    def apply(xs):
        out = np.empty_like(xs)
        loop(xs, out)
        return out

    return apply


def tanhs(peers: list[str]) -> dict:
    """{name: float32 array -> float32 tanh}, backplan's two and the peers asked for."""
    found = {"backplan tanh_f32": _loop(tanh_f32), "backplan rational": _loop(tanh_rational_f32)}
    if "numpy" in peers:
        found[f"numpy {np.__version__}"] = np.tanh
    if "torch" in peers:
        import torch

        torch.set_num_threads(1)
        found[f"torch {torch.__version__}"] = lambda x: torch.tanh(torch.from_numpy(x)).numpy()
    if "jax" in peers:
        import jax
        import jax.numpy as jnp

        jitted = jax.jit(jnp.tanh)
        found[f"jax {jax.__version__}"] = lambda x: np.asarray(jitted(x))
    return found


def sweep(fns: dict, stride: int = 1) -> dict:
    """{name: {"max_ulp", "at", "not_correctly_rounded", "inputs"}} over [0, 10]."""
    top = int(np.float32(10).view(np.int32)) + 1
    worst = {name: (0.0, 0.0) for name in fns}
    wrong = dict.fromkeys(fns, 0)
    inputs = 0
    for start in range(0, top, CHUNK * stride):
        bits = np.arange(start, min(start + CHUNK * stride, top), stride, dtype=np.int32)
        xs = bits.view(np.float32)
        exact = np.tanh(xs.astype(np.float64))
        rounded = exact.astype(np.float32)
        spacing = np.spacing(rounded).astype(np.float64)
        inputs += xs.size
        for name, fn in fns.items():
            got = fn(xs)
            ulps = np.abs(got.astype(np.float64) - exact) / spacing
            ulps[got == rounded] = 0.0
            i = int(np.argmax(ulps))
            if ulps[i] > worst[name][0]:
                worst[name] = (float(ulps[i]), float(xs[i]))
            wrong[name] += int((got != rounded).sum())
    return {
        name: {
            "max_ulp": round(worst[name][0], 3),
            "at": worst[name][1],
            "not_correctly_rounded": wrong[name],
            "inputs": inputs,
        }
        for name in fns
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", default="numpy,torch,jax")
    parser.add_argument("--stride", type=int, default=1, help="every n-th float32 pattern")
    args = parser.parse_args(argv)
    began = time.perf_counter()
    found = sweep(tanhs(args.peers.split(",")), args.stride)
    for name, row in found.items():
        share = row["not_correctly_rounded"] / row["inputs"]
        print(
            f"{name:26} max {row['max_ulp']:.2f} ulp at {row['at']!r}; not correctly rounded "
            f"on {share:.2%} of {row['inputs']:,} inputs"
        )
    print(json.dumps({"stride": args.stride, "seconds": time.perf_counter() - began, **found}))


if __name__ == "__main__":
    main()
