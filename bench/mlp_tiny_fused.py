"""backplan's mlp_tiny training step against the same step hand-fused in Numba: one compiled
function a user who writes the loops and the derivative by hand would call, the bar for the
small-model call path (issue 36 target: backplan within 1.5x).

    python -m backplan.bench.mlp_tiny_fused --threads 1 --rounds 9

The step is the bench model's (bench/models/mlp.py, MLP 32-64-64-10, ReLU, cross-entropy
averaged over a batch of 16, float32): the loss and the gradients of every weight and bias.
backplan runs `bp.value_and_grad(bp.compile(loss))` with bp.tensor arguments (its compiled
driver, built before timing starts); the hand-fused step is one njit call over preallocated
buffers doing the forward, the softmax cross-entropy and the backward in loops. Both are checked
against a float64 NumPy reference (bench/peers/numpy_mlp.py); rounds are interleaved and the
table has medians of each round's median per call.
"""

from __future__ import annotations

import argparse
import sys

import numba
import numpy as np

from .affinity import pin_process
from .environment import load_average
from .ln_gelu_fused import print_against_hand_fused
from .measure import interleaved_medians, max_relative_error
from .threads import apply_threads

MODEL = "mlp_tiny"
NAMES = ("w0", "b0", "w1", "b1", "w2", "b2")  # the order of gradients in every peer's step
_opts = {"fastmath": True, "error_model": "numpy", "nogil": True, "cache": False}


@numba.njit(inline="always", **_opts)
def _dense_relu(a, w, b, out, relu):
    """out = a @ w + b, then max(out, 0) when relu; rows outer so each row stays in L1. The
    inner loops index 1-D row views: LLVM vectorises them (2-D indexing ran at half the rate)."""
    for r in range(a.shape[0]):
        row = out[r]
        row[:] = b
        for k in range(a.shape[1]):
            av, w_row = a[r, k], w[k]
            for j in range(row.shape[0]):
                row[j] += av * w_row[j]
        if relu:
            for j in range(row.shape[0]):
                row[j] = max(row[j], np.float32(0.0))


@numba.njit(inline="always", **_opts)
def _dense_back(a, d, w, gw, gb, da):
    """gw = a.T @ d, gb = column sums of d, and when da has rows da = (d @ w.T) * (a > 0):
    a is the previous ReLU's output, so a > 0 is its derivative."""
    gw[:, :] = 0
    gb[:] = 0
    for r in range(d.shape[0]):
        d_row = d[r]
        for k in range(a.shape[1]):
            av, gw_row = a[r, k], gw[k]
            for j in range(d_row.shape[0]):
                gw_row[j] += av * d_row[j]
        for j in range(d_row.shape[0]):
            gb[j] += d_row[j]
    for r in range(da.shape[0]):
        d_row = d[r]
        for k in range(w.shape[0]):
            w_row = w[k]
            total = np.float32(0.0)
            for j in range(d_row.shape[0]):
                total += d_row[j] * w_row[j]
            da[r, k] = total if a[r, k] > 0 else np.float32(0.0)


@numba.njit(inline="always", **_opts)
def _cross_entropy(logits, labels, d):
    """Mean softmax cross-entropy over rows; d gets its gradient with respect to logits."""
    rows, classes = logits.shape
    scale = np.float32(1.0 / rows)
    loss = np.float32(0.0)
    for r in range(rows):
        top = logits[r, 0]
        for j in range(1, classes):
            top = max(top, logits[r, j])
        total = np.float32(0.0)
        for j in range(classes):
            d[r, j] = np.exp(logits[r, j] - top)
            total += d[r, j]
        loss += np.log(total) + top - logits[r, labels[r]]
        for j in range(classes):
            d[r, j] = d[r, j] / total * scale
        d[r, labels[r]] -= scale
    return loss * scale


@numba.njit(inline="always", **_opts)
def _cut(flat, start, rows, cols):
    """flat[start:] as a (rows, cols) view, and the offset past it."""
    end = start + rows * cols
    return flat[start:end].reshape((rows, cols)), end


@numba.njit(**_opts)
def fused_step(x, labels, theta, grads, work, dims):
    """The whole step. theta and grads hold (w0, b0, w1, b1, w2, b2) back to back, work the
    activations and their gradients: one call unboxes five arrays, not fifteen (Numba's
    dispatcher takes ~1 us per array argument, as much as a layer of this model). Views are cut
    one by one (no lists: a typed list allocates on every call)."""
    n0, n1, n2, n3 = dims
    batch = x.shape[0]
    w0, at = _cut(theta, 0, n0, n1)
    b0, at = _cut(theta, at, 1, n1)
    w1, at = _cut(theta, at, n1, n2)
    b1, at = _cut(theta, at, 1, n2)
    w2, at = _cut(theta, at, n2, n3)
    b2, at = _cut(theta, at, 1, n3)
    gw0, at = _cut(grads, 0, n0, n1)
    gb0, at = _cut(grads, at, 1, n1)
    gw1, at = _cut(grads, at, n1, n2)
    gb1, at = _cut(grads, at, 1, n2)
    gw2, at = _cut(grads, at, n2, n3)
    gb2, at = _cut(grads, at, 1, n3)
    h1, at = _cut(work, 0, batch, n1)
    h2, at = _cut(work, at, batch, n2)
    out, at = _cut(work, at, batch, n3)
    d2, at = _cut(work, at, batch, n3)
    d1, at = _cut(work, at, batch, n2)
    d0, at = _cut(work, at, batch, n1)
    _dense_relu(x, w0, b0[0], h1, True)
    _dense_relu(h1, w1, b1[0], h2, True)
    _dense_relu(h2, w2, b2[0], out, False)
    loss = _cross_entropy(out, labels, d2)
    _dense_back(h2, d2, w2, gw2, gb2[0], d1)
    _dense_back(h1, d1, w1, gw1, gb1[0], d0)
    _dense_back(x, d0, w0, gw0, gb0[0], x[:0])
    return loss


def hand_fused(params: dict, x: np.ndarray, labels: np.ndarray):
    """step() -> (loss, [gradients in params' order]) over buffers made once."""
    theta = np.concatenate([params[name].ravel() for name in NAMES]).astype(np.float32)
    grads = np.empty_like(theta)
    dims = (x.shape[1], params["w0"].shape[1], params["w1"].shape[1], params["w2"].shape[1])
    work = np.empty(x.shape[0] * 2 * (dims[1] + dims[2] + dims[3]), np.float32)
    ends = np.cumsum([params[name].size for name in NAMES])
    views = [
        grads[end - params[name].size : end].reshape(params[name].shape)
        for name, end in zip(NAMES, ends, strict=True)
    ]

    def step():
        return fused_step(x, labels, theta, grads, work, dims), views

    return step


def backplan_step(params: dict, x: np.ndarray, labels: np.ndarray):
    """The bench's joint step with tensor arguments; outputs stay tensors inside the timing."""
    import backplan as bp
    from backplan.bench.internals import driver_builder

    from .models import MODELS
    from .peers.backplan_peer import bench_function

    fn = bp.value_and_grad(bp.compile(bench_function(MODELS[MODEL])), argnums=0)
    args = ({k: bp.tensor(v) for k, v in params.items()}, bp.tensor(x), bp.tensor(labels))
    fn(*args)
    driver_builder.wait_for_builds()

    def step():
        value, grads = fn(*args)
        return value, [grads[name] for name in NAMES]

    return step


def reference(params: dict, x: np.ndarray, labels: np.ndarray):
    """Loss and gradients in float64 NumPy (bench/peers/numpy_mlp.py)."""
    from .peers.numpy_mlp import backward, forward

    p64 = {name: value.astype(np.float64) for name, value in params.items()}
    value, cache = forward(p64, x.astype(np.float64), labels)
    grads = backward(p64, cache)
    return value, [grads[name] for name in NAMES]


def _error(step, want_value, want) -> float:
    value, grads = step()
    got = [np.asarray(g.numpy() if hasattr(g, "numpy") else g) for g in grads]
    value = float(value.numpy() if hasattr(value, "numpy") else value)
    return max(max_relative_error(got, want), abs(value - want_value) / abs(want_value))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--seconds", type=float, default=0.3, help="timed per peer and round")
    args = parser.parse_args(argv)
    settings = pin_process(args.threads) | apply_threads(args.threads)
    from .models import MODELS

    inputs = MODELS[MODEL].inputs(small=False, dtype=np.float32)
    params = {k: np.ascontiguousarray(v, np.float32) for k, v in inputs.params.items()}
    x, labels = inputs.batch(True)
    x = np.ascontiguousarray(x, np.float32)
    peers = {
        "backplan": backplan_step(params, x, labels),
        "hand-fused Numba": hand_fused(params, x, labels),
    }
    want_value, want = reference(params, x, labels)
    errors = {name: _error(step, want_value, want) for name, step in peers.items()}
    load_before = load_average()
    medians = interleaved_medians(peers, args.rounds, args.seconds, inner=20)
    heading = (f"python -m backplan.bench.mlp_tiny_fused {' '.join(argv or sys.argv[1:])}",)
    print_against_hand_fused(
        heading, args.threads, load_before, settings, medians, errors, unit="us", scale=1e3
    )
    return 0 if all(e < 1e-4 for e in errors.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
