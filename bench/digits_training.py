"""The digits CNN trained end to end by backplan (backplan/examples/cnn_digits.py) and by the
same network, optimizer and data order in PyTorch eager: test accuracy and median step time.

    python -m backplan.bench.digits_training --threads 1

Both steps are timed the same way: from the NumPy batch to the loss as a Python float, forward,
backward, gradient clipping and the Adam update included. Needs scikit-learn (the [examples]
extra); the PyTorch row is skipped when torch is not installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import time

import numpy as np

from backplan.examples import cnn_digits

from .threads import apply_threads


def torch_model():
    """conv-relu-pool x2, dropout, linear: cnn_digits.logits as torch.nn modules, with the same
    initialisation (He-normal weights on fan-in, zero biases)."""
    import torch
    from torch import nn

    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Dropout(cnn_digits.DROPOUT),
        nn.Linear(128, 10),
    )
    for layer in model:
        if isinstance(layer, nn.Conv2d | nn.Linear):
            nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
            torch.nn.init.zeros_(layer.bias)
    return model


def train_torch(epochs: int = 12, batch_size: int = 32, seed: int = 0) -> dict:
    """cnn_digits.train's loop in PyTorch eager: {'losses', 'test_accuracy', 'step_ms', 'steps'}."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(seed)
    x_train, y_train, x_test, y_test = cnn_digits.load_digits_split(seed=seed)
    model = torch_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=cnn_digits.LEARNING_RATE)
    losses, times = [], []
    for batch in cnn_digits.shuffled_batches(len(y_train), batch_size, epochs, seed):
        begin = time.perf_counter()
        x, y = torch.from_numpy(x_train[batch]), torch.from_numpy(y_train[batch])
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cnn_digits.MAX_GRAD_NORM)
        optimizer.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - begin)
    model.eval()
    with torch.no_grad():
        predicted = model(torch.from_numpy(x_test)).argmax(dim=1).numpy()
    return {
        "losses": losses,
        "test_accuracy": float(np.mean(predicted == y_test)),
        "step_ms": 1000 * float(np.median(times[1:] or times)),
        "steps": len(losses),
    }


def report_line(name: str, result: dict) -> str:
    last = np.mean(result["losses"][-20:])
    return (
        f"| {name} | {result['steps']} | {last:.3f} | {100 * result['test_accuracy']:.2f}% "
        f"| {result['step_ms']:.2f} |"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--threads", type=int, default=None, help="limit every library's pool")
    args = parser.parse_args(argv)
    has_torch = importlib.util.find_spec("torch") is not None
    if has_torch:
        import torch  # noqa: F401 - loaded before apply_threads so its pool is limited too
    apply_threads(args.threads)
    print("| trainer | steps | loss (last 20) | test accuracy | median step ms |")
    print("|---|---:|---:|---:|---:|")
    print(report_line("backplan (one compiled step)", cnn_digits.train(epochs=args.epochs)))
    if has_torch:
        print(report_line("PyTorch eager", train_torch(epochs=args.epochs)))
    else:
        print("| PyTorch eager | skipped: torch is not installed | | | |")


if __name__ == "__main__":
    main()
