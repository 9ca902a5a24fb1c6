"""How far compiled 16-bit steps are from the reference interpreter, in ulps of the result:
each bench model's value_and_grad step (loss and every gradient) in bfloat16 and float16,
compiled against the reference backend (the interpreter running the lowered plan, rounding
where the compiled loops round: ir/rounding_points.py) and against the same step run eagerly
(every op's result rounded); both against the step in float64 on the same 16-bit values.

    python -m backplan.bench.half_ulps [--models mlp,transformer,ln_gelu] [--small] [--floor]

A distance is |compiled - reference| over the 16-bit spacing at the reference value (the
smallest normal's below it); per model and dtype: the largest over all outputs, the 99th
percentile over all their elements, how many are over one ulp apart and the share
bit-equal (a reference of exactly 0 makes any other value ~1e29 ulps). --floor adds the
reference backend against itself with every matmul's float32 result summed another way (in
float64, then rounded to float32): how far float32 summation order alone moves the 16-bit
results, which the compiled GEMMs' order does too.
"""

from __future__ import annotations

import argparse
import contextlib

import ml_dtypes
import numpy as np

import backplan as bp

from .half_precision import _bound
from .models import MODELS

DTYPES = {"bf16": ml_dtypes.bfloat16, "f16": np.float16}


def ulps(got: np.ndarray, want: np.ndarray, dtype) -> np.ndarray:
    """Per element distance in 16-bit ulps at `want` (inf where a non-finite value differs)."""
    g, w = got.astype(np.float64).ravel(), want.astype(np.float64).ravel()
    info = ml_dtypes.finfo(dtype)
    spacing = np.exp2(np.floor(np.log2(np.maximum(np.abs(w), float(info.smallest_normal)))))
    with np.errstate(invalid="ignore"):
        apart = np.abs(g - w) / (spacing * 2.0**-info.nmant)
    same = (g == w) | (np.isnan(g) & np.isnan(w))
    return np.where(same, 0.0, np.where(np.isfinite(apart), apart, np.inf))


def step_outputs(name: str, dtype, small: bool, backend: str, wide=None) -> list[np.ndarray]:
    """Loss, then every gradient, of one value_and_grad step on `backend` (wide: the same
    16-bit values held in that wider dtype)."""
    from .internals import use_backend

    spec = MODELS[name]
    data = spec.inputs(small, np.float32)

    def held(a):
        return a.astype(dtype).astype(wide or dtype)

    params = {k: bp.tensor(held(v)) for k, v in data.params.items()}
    batch = [held(b) if b.dtype.kind == "f" else b for b in data.batch(True)]
    with use_backend(backend):
        value, grads = bp.value_and_grad(_bound(spec))(params, *batch)
    return [value.numpy()] + [g.numpy() for g in _leaves(grads)]


def eager_outputs(name: str, dtype, small: bool) -> list[np.ndarray]:
    """The same step run eagerly (tensors outside bp.compile, then backward()): every op's
    result rounded."""
    spec = MODELS[name]
    data = spec.inputs(small, np.float32)
    params = {k: bp.tensor(v.astype(dtype), requires_grad=True) for k, v in data.params.items()}
    batch = [b.astype(dtype) if b.dtype.kind == "f" else b for b in data.batch(True)]
    loss = _bound(spec)(params, *[bp.tensor(b) for b in batch])
    loss.backward()
    return [loss.numpy()] + [p.grad.numpy() for p in _leaves(params)]


def _leaves(tree) -> list:
    """A model's parameters (or their gradients) in one order: nested dicts by key."""
    if isinstance(tree, dict):
        return [leaf for key in sorted(tree) for leaf in _leaves(tree[key])]
    if isinstance(tree, (list, tuple)):
        return [leaf for item in tree for leaf in _leaves(item)]
    return [tree]


@contextlib.contextmanager
def matmul_summed_in_float64():
    """The reference interpreter's matmul as the float64 product rounded to float32."""
    from .internals import get_op

    op = get_op("matmul")
    kept = op.reference

    def summed(a, b, dtype=None):
        product = np.matmul(np.asarray(a, np.float64), np.asarray(b, np.float64))
        return product.astype(np.float32 if dtype is not None else np.result_type(a, b))

    object.__setattr__(op, "reference", summed)
    try:
        yield
    finally:
        object.__setattr__(op, "reference", kept)


def summary(compiled: list, reference: list, dtype) -> str:
    per = [ulps(c, r, dtype) for c, r in zip(compiled, reference, strict=True)]
    every = np.concatenate(per)
    largest = max(float(p.max(initial=0.0)) for p in per)
    loss = float(per[0].max(initial=0.0))
    return (
        f"loss {loss:.2f}, max {largest:.3g}, p99 {np.percentile(every, 99):.2f}, "
        f"over 1 ulp {int(np.sum(every > 1)):,}, "
        f"bit-equal {100 * np.mean(every == 0):.2f}% of {every.size:,}"
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,transformer,ln_gelu")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--floor", action="store_true")
    args = parser.parse_args(argv)
    for name in args.models.split(","):
        for label, dtype in DTYPES.items():
            compiled = step_outputs(name, dtype, args.small, "numba")
            reference = step_outputs(name, dtype, args.small, "reference")
            eager = eager_outputs(name, dtype, args.small)
            exact = step_outputs(name, dtype, args.small, "reference", wide=np.float64)
            print(f"{name} {label}: compiled vs reference  {summary(compiled, reference, dtype)}")
            print(f"{name} {label}: compiled vs eager      {summary(compiled, eager, dtype)}")
            print(f"{name} {label}: compiled vs float64    {summary(compiled, exact, dtype)}")
            print(f"{name} {label}: eager vs float64       {summary(eager, exact, dtype)}")
            if args.floor:
                with matmul_summed_in_float64():
                    other = step_outputs(name, dtype, args.small, "reference")
                line = summary(other, reference, dtype)
                print(f"{name} {label}: reference, matmul summed in float64: {line}")


if __name__ == "__main__":
    main()
