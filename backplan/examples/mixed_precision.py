"""Mixed-precision training: the digits CNN (backplan.examples.cnn_digits) with bfloat16
parameters, images and activations, float32 master weights in the optimizer, and float32
arithmetic inside every op (bfloat16 is storage: each op computes in float32 and rounds what
it stores). The same model, data order and dropout keys are trained in float32 beside it, and
the two test accuracies are reported with their difference.

    pip install -e ".[examples]" && python -m backplan.examples.mixed_precision [--seeds 0,1,2]

What it shows: the bfloat16 run comes close to the float32 accuracy while its parameters,
activations and saved buffers take half the bytes. Over seeds 0-4 (`compare(seed=s)`, 12
epochs, 359 held-out digits, one image = 0.28 points; AMD EPYC, bfloat16 GEMMs on VDPBF16PS)
the gaps are +0.56, -0.28, -0.56, 0, 0 points (mean -0.06); PyTorch's autocast bfloat16 on the
same CNN gives -0.84 to +1.11 over ten seeds (mean +0.22): a single seed's gap is noise.
The optimizer keeps float32 master weights (`master_dtype=bp.float32`):
an update of 3e-3 times a weight rounds away in bfloat16 itself (8 significant bits), so
without them small steps are lost.
"""

from __future__ import annotations

import numpy as np

import backplan as bp
from backplan.examples import cnn_digits

DTYPES = {"float32": np.float32, "bfloat16": bp.bfloat16}


def optimizer(dtype):
    """cnn_digits' clipped Adam; for 16-bit parameters with float32 master weights."""
    master = None if dtype is np.float32 else bp.float32
    return bp.optim.chain(
        bp.optim.clip_by_global_norm(cnn_digits.MAX_GRAD_NORM),
        bp.optim.adam(cnn_digits.LEARNING_RATE),
        master_dtype=master,
    )


def make_train_step(opt):
    """One compiled call: forward, backward, update and the next dropout key."""

    def train_step(params, opt_state, x, labels, key):
        key, dropout_key = bp.random.split(key)
        loss, grads = bp.value_and_grad(cnn_digits.loss_fn)(params, x, labels, dropout_key)
        params, opt_state = opt.update(grads, opt_state, params)
        return params, opt_state, key, loss

    return bp.compile(train_step, donate_argnums=(0, 1))


def train(dtype=bp.bfloat16, epochs: int = 12, batch_size: int = 32, max_steps=None, seed=0):
    """Train in dtype and report {'losses', 'test_accuracy', 'step_ms', 'steps'}."""
    x_train, y_train, x_test, y_test = cnn_digits.load_digits_split(seed=seed)
    key = bp.random.key(seed)
    key, init_key = bp.random.split(key)
    params = {k: v.astype(dtype) for k, v in cnn_digits.init_params(init_key).items()}
    opt = optimizer(dtype)
    split = (x_train.astype(dtype), y_train, x_test.astype(dtype), y_test)
    schedule = dict(epochs=epochs, batch_size=batch_size, max_steps=max_steps, seed=seed)
    return cnn_digits.run_training(
        make_train_step(opt), params, opt.init(params), key, split, schedule
    )


def compare(**options) -> dict:
    """Both runs, same seed and batches: {'float32': result, 'bfloat16': result}."""
    return {name: train(dtype, **options) for name, dtype in DTYPES.items()}


def main(argv=None) -> None:
    """One comparison per seed (--seeds 0,1,2,3,4), then the gaps' mean and range."""
    import argparse

    parser = argparse.ArgumentParser(description="digits CNN: bfloat16 against float32")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    gaps = [_report(int(seed)) for seed in parser.parse_args(argv).seeds.split(",")]
    if len(gaps) > 1:
        print(
            f"{len(gaps)} seeds: gap mean {np.mean(gaps):+.2f} points, "
            f"from {min(gaps):+.2f} to {max(gaps):+.2f}"
        )


def _report(seed: int) -> float:
    results = compare(seed=seed)
    for name, result in results.items():
        last = np.mean(result["losses"][-20:])
        print(
            f"seed {seed} {name:>8}: {result['steps']} steps, final loss {last:.3f}, test "
            f"accuracy {100 * result['test_accuracy']:.2f}%, {result['step_ms']:.2f} ms per step"
        )
    gap = 100 * (results["bfloat16"]["test_accuracy"] - results["float32"]["test_accuracy"])
    print(f"seed {seed}: bfloat16 - float32 test accuracy: {gap:+.2f} points")
    return gap


if __name__ == "__main__":
    main()
