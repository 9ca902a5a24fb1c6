"""JAX: jax.jit(jax.value_and_grad(loss)), imported only when this peer runs."""

from __future__ import annotations

import importlib.util

import numpy as np

from ..models import ModelInputs, ModelSpec
from .base import Peer, Runner, SavedBytes, StepOutput, as_float64


class JaxRunner(Runner):
    def __init__(self, spec: ModelSpec, inputs: ModelInputs):
        import jax

        from .jax_models import JAX_KINDS

        self.jax, self.spec = jax, spec
        if any(a.dtype == np.float64 for a in inputs.params.values()):
            jax.config.update("jax_enable_x64", True)
        self.params = {k: jax.numpy.asarray(v) for k, v in inputs.params.items()}
        self.batch = [jax.numpy.asarray(a) for a in inputs.batch(spec.train)]
        loss_fn, forward_fn = JAX_KINDS[spec.kind]
        fn, static = (loss_fn if spec.train else forward_fn), spec.static

        def model(params, *batch):
            return fn(params, *batch, **static)

        self.model = model
        self.fn = jax.jit(jax.value_and_grad(model) if spec.train else model)
        self.result = None

    def step(self) -> None:
        self.result = self.jax.block_until_ready(self.fn(self.params, *self.batch))

    def output(self) -> StepOutput:
        if not self.spec.train:
            return StepOutput(as_float64(self.result), {})
        value, grads = self.result
        return StepOutput(as_float64(value), {k: as_float64(g) for k, g in grads.items()})

    def saved_bytes(self) -> SavedBytes | None:
        """The residuals jax.vjp of the jitted loss keeps for its backward."""
        if not self.spec.train:
            return None
        jitted = self.jax.jit(self.model)
        _, vjp_fn = self.jax.vjp(lambda p: jitted(p, *self.batch), self.params)
        residuals = self.jax.tree_util.tree_leaves(vjp_fn)
        inputs = [*self.params.values(), *self.batch]
        input_ptrs = {a.unsafe_buffer_pointer() for a in inputs}
        buffers = {
            a.unsafe_buffer_pointer(): a.nbytes
            for a in residuals
            if hasattr(a, "unsafe_buffer_pointer")
        }
        own = sum(n for ptr, n in buffers.items() if ptr not in input_ptrs)
        return SavedBytes(own, sum(buffers.values()), "jax.vjp residuals of the jitted loss")

    def planned_peak_bytes(self):
        compiled = self.fn.lower(self.params, *self.batch).compile()
        stats = compiled.memory_analysis()
        if stats is None:
            return None
        planned = stats.temp_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
        return planned, "XLA memory_analysis temp + output"


class JaxPeer(Peer):
    name = family = "jax"
    description = "jax.jit(jax.value_and_grad(loss))"
    warm_first_call = "after jax.clear_caches(): trace and compile again (no disk cache)"

    def missing(self) -> str | None:
        if importlib.util.find_spec("jax") is None:
            return "jax is not installed (pip install 'backplan[peers]')"
        return None

    def versions(self) -> dict[str, str]:
        import jax
        import jaxlib

        return {"jax": jax.__version__, "jaxlib": jaxlib.__version__}

    def clear_caches(self) -> None:
        import jax

        jax.clear_caches()

    def build(self, spec: ModelSpec, inputs: ModelInputs) -> Runner:
        return JaxRunner(spec, inputs)
