"""Imported PyTorch models: the bench's cnn and transformer written as torch.nn.Modules (the
torch peer's own functions over a ParameterDict), imported with bp.from_torch and stepped by
backplan (one bp.value_and_grad plan), beside the same module under torch eager and
torch.compile at equal threads.

    BACKPLAN_DRIVER=inline python -m backplan.bench.torch_import --threads 1

(inline: the first call builds the compiled driver, so the rounds time it, not the Python
driver that runs while it builds) prints, per model, import + first-call time against
torch.compile's first call, then the medians of interleaved rounds of forward + backward
steps, and the largest difference of the losses and gradients from torch eager's, relative
to the largest of them. `python -m backplan bench` runs every bench model this way (its
backplan.from_torch rows, with any torch peer); this script keeps the one-table view.
"""

from __future__ import annotations

import argparse

import numpy as np

from .affinity import pin_process
from .measure import interleaved_medians, time_call, timed
from .models import MODELS
from .peers import imported_peer
from .threads import apply_threads

MODEL_NAMES = ("cnn", "transformer")


def torch_module(name: str, small: bool):
    """(module, example inputs): the torch peer's loss function as a Module whose parameters
    are the bench model's."""
    import torch

    spec = MODELS[name]
    data = spec.make_inputs(spec.sizes(small), 0).cast(np.float32)
    return module_of(name, data.params), tuple(torch.from_numpy(a) for a in data.batch(True))


def module_of(name: str, params: dict):
    """The torch peer's loss function of model `name` as a Module holding copies of `params`
    (NumPy arrays) as its parameters; calling it with the batch gives the loss."""
    return imported_peer.module_of(MODELS[name], params)


def backplan_runner(module, batch):
    """(import seconds, first step seconds, step, grads of the last step)."""
    import backplan as bp

    imported, (fn, params) = timed(lambda: bp.from_torch(module, batch))
    arrays = [b.numpy() for b in batch]

    def imported_step(params, *xs):
        return fn(params, *xs)

    imported_step.__name__ = fn.__name__
    step = bp.value_and_grad(imported_step)
    first, loss_and_grads = timed(lambda: step(params, *arrays))
    result = [loss_and_grads]

    def run():
        result[0] = step(params, *arrays)

    def values():
        loss, grads = result[0]
        return [loss.numpy(), *(grads[k].numpy() for k in sorted(grads))]

    return imported, first, run, values


def torch_runner(module, batch, compiled: bool):
    """(first step seconds, step, values): forward + backward under eager or torch.compile."""
    import torch

    model = torch.compile(module) if compiled else module
    last = {}

    def run():
        module.zero_grad(set_to_none=True)
        loss = model(*batch)
        loss.backward()
        last["loss"] = loss

    first = time_call(run)

    def values():
        grads = {f"p.{k}": p.grad for k, p in module.p.items()}
        return [last["loss"].detach().numpy(), *(grads[k].numpy() for k in sorted(grads))]

    return first, run, values


def measure(name: str, small: bool, rounds: int, seconds: float, compile_torch: bool) -> dict:
    module, batch = torch_module(name, small)
    imported, first, bp_step, bp_values = backplan_runner(module, batch)
    eager_first, eager_step, eager_values = torch_runner(module, batch, compiled=False)
    steps = {"backplan (imported)": bp_step, "torch eager": eager_step}
    firsts = {"backplan import": imported, "backplan first step": first}
    if compile_torch:
        compiled_first, compiled_step, _ = torch_runner(module, batch, compiled=True)
        steps["torch.compile"] = compiled_step
        firsts["torch.compile first step"] = compiled_first
    medians = interleaved_medians(steps, rounds, seconds)
    eager_step()
    bp_step()
    error = _difference(bp_values(), eager_values())
    return {"model": name, "first": firsts, "medians": medians, "error": error}


def _difference(got: list, want: list) -> float:
    """The largest |got - want| over the largest |want| of all arrays together: a gradient that
    is zero in exact arithmetic (attention's key bias) has no scale of its own."""
    scale = max(float(np.abs(w).max()) for w in want) + 1e-30
    return max(float(np.abs(g - w).max()) for g, w in zip(got, want, strict=True)) / scale


def report(result: dict) -> str:
    first = ", ".join(f"{k} {v:.2f} s" for k, v in result["first"].items())
    steps = " | ".join(f"{v:.3f}" for v in result["medians"].values())
    return f"| {result['model']} | {steps} | {result['error']:.1e} | {first} |"


def main(argv: list[str] | None = None) -> None:
    """Pin and limit the threads, then print one table row per model."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="pin and limit every pool")
    parser.add_argument("--small", action="store_true", help="the test sizes")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.5, help="per step and round")
    parser.add_argument("--no-torch-compile", action="store_true")
    parser.add_argument("--models", nargs="*", default=list(MODEL_NAMES), choices=MODEL_NAMES)
    args = parser.parse_args(argv)
    import torch  # noqa: F401 - loaded before apply_threads so its pool is limited too

    pin_process(args.threads)
    apply_threads(args.threads)
    compile_torch = not args.no_torch_compile
    names = ["backplan (imported)", "torch eager"] + (["torch.compile"] if compile_torch else [])
    print(f"| model | {' | '.join(f'{n} ms' for n in names)} | max rel. diff | first calls |")
    print("|---|" + "---:|" * len(names) + "---:|---|")
    for name in args.models:
        result = measure(name, args.small, args.rounds, args.seconds, compile_torch)
        print(report(result), flush=True)


if __name__ == "__main__":
    main()
