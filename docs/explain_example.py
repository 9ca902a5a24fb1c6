"""The example of docs/explain.md: one training step of a small model, explained before it runs.
`python docs/explain_example.py` prints the report and writes docs/explain_example.png."""

import os

import numpy as np

import backplan as bp


@bp.compile
def loss_fn(params, x, y):
    hidden = bp.tanh(x @ params["w1"])
    return bp.mse_loss(hidden @ params["w2"], y)


def example_inputs():
    rng = np.random.default_rng(0)
    params = {
        "w1": bp.tensor(rng.standard_normal((32, 64)).astype(np.float32), requires_grad=True),
        "w2": bp.tensor(rng.standard_normal((64, 8)).astype(np.float32), requires_grad=True),
    }
    x = bp.tensor(rng.standard_normal((16, 32)).astype(np.float32))
    y = bp.tensor(rng.standard_normal((16, 8)).astype(np.float32))
    return params, x, y


def write_small_png(report, path):
    """The picture with its colours reduced to a palette, so the file stays small."""
    report.plot(path)
    try:
        from PIL import Image
    except ImportError:
        return
    Image.open(path).convert("RGB").quantize(colors=64).save(path, optimize=True)


if __name__ == "__main__":
    report = loss_fn.explain(*example_inputs())
    print(report)
    write_small_png(
        report, os.path.join(os.path.dirname(os.path.abspath(__file__)), "explain_example.png")
    )
