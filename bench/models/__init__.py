"""The benchmark suite. Each model is written once for backplan (in this package); every peer
provides the idiomatic version of the same `kind`. Full sizes are what a normal run measures;
`small_config` shrinks them for the tests (`--small`), and the output says so."""

from __future__ import annotations

from ..errors import BenchError
from . import cnn, ln_gelu, lstm, mlp, transformer
from .spec import ModelInputs, ModelSpec

MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in [
        ModelSpec(
            "mlp",
            "mlp",
            "MLP 784-512-512-10, ReLU, cross-entropy, batch 128",
            dict(n_in=784, width=512, depth=2, n_out=10, batch=128),
            dict(n_in=24, width=16, depth=2, n_out=10, batch=8),
            mlp.make_inputs,
            static=dict(activation="relu"),
        ),
        ModelSpec(
            "mlp_tiny",
            "mlp",
            "MLP 32-64-64-10, ReLU, cross-entropy, batch 16",
            dict(n_in=32, width=64, depth=2, n_out=10, batch=16),
            dict(n_in=12, width=8, depth=2, n_out=10, batch=4),
            mlp.make_inputs,
            static=dict(activation="relu"),
        ),
        ModelSpec(
            "transformer",
            "transformer",
            "pre-LN block, d_model 256, 4 heads, MLP 1024 tanh-GELU, batch 8, seq 128, mean(y^2)",
            dict(batch=8, seq=128, d_model=256, d_ff=1024),
            dict(batch=2, seq=6, d_model=16, d_ff=32),
            transformer.make_inputs,
            static=dict(n_heads=4),
        ),
        ModelSpec(
            "ln_gelu",
            "ln_gelu",
            "gelu(layer_norm(x) * g + b) + x on 4096x1024, sum(y * upstream)",
            dict(rows=4096, cols=1024),
            dict(rows=8, cols=32),
            ln_gelu.make_inputs,
        ),
        ModelSpec(
            "mlp_deep",
            "mlp",
            "deep narrow MLP 128-(128 x 32)-10, tanh, batch 256 (memory)",
            dict(n_in=128, width=128, depth=32, n_out=10, batch=256),
            dict(n_in=12, width=8, depth=6, n_out=10, batch=4),
            mlp.make_inputs,
            static=dict(activation="tanh"),
        ),
        ModelSpec(
            "mlp_infer",
            "mlp",
            "inference only: forward of mlp (784-512-512-10, batch 128)",
            dict(n_in=784, width=512, depth=2, n_out=10, batch=128),
            dict(n_in=24, width=16, depth=2, n_out=10, batch=8),
            mlp.make_inputs,
            static=dict(activation="relu"),
            train=False,
        ),
        ModelSpec(
            "cnn",
            "cnn",
            "CNN (conv3x3-ReLU-maxpool2) x2 16/32 ch, linear, cross-entropy, 1x8x8, batch 32",
            dict(batch=32, c_in=1, side=8, c1=16, c2=32, n_out=10),
            dict(batch=4, c_in=2, side=4, c1=3, c2=4, n_out=5),
            cnn.make_inputs,
        ),
        ModelSpec(
            "lstm12",
            "lstm",
            "LSTM unrolled over 12 steps, 4 inputs, 16 hidden, batch 8, MSE of the last state",
            dict(steps=12, batch=8, n_in=4, hidden=16),
            dict(steps=2, batch=2, n_in=3, hidden=4),
            lstm.make_inputs,
        ),
        ModelSpec(
            "lstm48",
            "lstm",
            "LSTM unrolled over 48 steps, 4 inputs, 16 hidden, batch 8, MSE of the last state",
            dict(steps=48, batch=8, n_in=4, hidden=16),
            dict(steps=3, batch=2, n_in=3, hidden=4),
            lstm.make_inputs,
        ),
    ]
}

# The backplan implementation of each kind: (loss, forward). Forward is None where the kind
# has no inference benchmark.
BACKPLAN_KINDS = {
    "mlp": (mlp.loss, mlp.logits),
    "transformer": (transformer.loss, None),
    "ln_gelu": (ln_gelu.loss, None),
    "cnn": (cnn.loss, cnn.logits),
    "lstm": (lstm.loss, None),
}


def select_models(names: list[str] | None) -> list[ModelSpec]:
    """The models to run, in suite order; unknown names raise BenchError listing the choices."""
    if not names:
        return list(MODELS.values())
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise BenchError(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    return [MODELS[n] for n in names]


__all__ = ["MODELS", "BACKPLAN_KINDS", "ModelInputs", "ModelSpec", "select_models"]


def value_and_grad_step(name: str):
    """(step, args) for a model at its documented sizes in float32: what a user writes first,
    `bp.value_and_grad(bp.compile(loss))`, and the arguments of its call (the warm-start and
    first-minute benchmarks time it in fresh processes)."""
    import numpy as np

    import backplan as bp

    spec = MODELS[name]
    data = spec.make_inputs(spec.config, 0).cast(np.float32)
    base = BACKPLAN_KINDS[spec.kind][0]
    loss = (lambda p, *b: base(p, *b, **spec.static)) if spec.static else base
    params = {k: bp.tensor(v) for k, v in data.params.items()}
    args = [params, *(bp.tensor(b) for b in data.batch(True))]
    return bp.value_and_grad(bp.compile(loss)), args
