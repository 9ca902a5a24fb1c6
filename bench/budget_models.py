"""The models the memory-budget scripts plan and time (memory_budget, memory_budget_train,
early_updates): kept apart so those scripts import it and not each other."""

from __future__ import annotations

import numpy as np

import backplan as bp

from .models import MODELS
from .models import transformer as transformer_model
from .peers.backplan_peer import bench_function

FRACTIONS = (1, 1 / 3, 1 / 5)


def transformer6():
    """The bench transformer's block stacked 6 deep, each block its own parameters."""
    spec = MODELS["transformer"]
    blocks = [spec.inputs(False, np.float32, seed=s) for s in range(6)]

    def stacked(params, x):
        for i in range(6):
            x = transformer_model.block(
                {k[3:]: v for k, v in params.items() if k[:3] == f"b{i}_"}, x, n_heads=4
            )
        return bp.mean(x * x)

    params = {f"b{i}_{k}": v for i, b in enumerate(blocks) for k, v in b.params.items()}
    return stacked, params, blocks[0].batch(True)


def mlp_deep():
    spec = MODELS["mlp_deep"]
    inputs = spec.inputs(False, np.float32)
    return bench_function(spec), inputs.params, inputs.batch(True)


def deep_chain(layers: int = 1120):
    """A tanh MLP of 16-wide layers: about 12 joint-plan nodes per layer."""
    rng = np.random.default_rng(0)
    params = {
        f"w{i}": (rng.standard_normal((16, 16)) * 0.3).astype(np.float32) for i in range(layers)
    }

    def chain(params, x):
        for i in range(layers):
            x = bp.tanh(x @ params[f"w{i}"])
        return bp.mean(x * x)

    return chain, params, (rng.standard_normal((256, 16)).astype(np.float32),)


def transformer():
    spec = MODELS["transformer"]
    inputs = spec.inputs(False, np.float32)
    return bench_function(spec), inputs.params, inputs.batch(True)


MODEL_MAKERS = {"mlp_deep": mlp_deep, "transformer6": transformer6, "transformer": transformer}
