"""PyTorch eager and torch.compile, imported only when these peers run."""

from __future__ import annotations

import importlib.util

from ..models import ModelInputs, ModelSpec
from .base import Peer, Runner, SavedBytes, StepOutput, as_float64


class TorchRunner(Runner):
    """Eager or compiled: params are leaf tensors; a step sets .grad to None, runs the loss
    and calls backward(), as a training loop with zero_grad(set_to_none=True) does."""

    def __init__(self, spec: ModelSpec, inputs: ModelInputs, compiled: bool):
        import torch

        from .torch_models import TORCH_KINDS

        self.torch, self.spec = torch, spec
        self.params = {
            k: torch.from_numpy(v.copy()).requires_grad_(spec.train)
            for k, v in inputs.params.items()
        }
        self.batch = [torch.from_numpy(a.copy()) for a in inputs.batch(spec.train)]
        loss_fn, forward_fn = TORCH_KINDS[spec.kind]
        fn, static = (loss_fn if spec.train else forward_fn), spec.static

        def model(params, *batch):
            return fn(params, *batch, **static)

        self.fn = torch.compile(model) if compiled else model
        self.value = None

    def step(self) -> None:
        if not self.spec.train:
            with self.torch.inference_mode():
                self.value = self.fn(self.params, *self.batch)
            return
        for p in self.params.values():
            p.grad = None
        self.value = self.fn(self.params, *self.batch)
        self.value.backward()

    def output(self) -> StepOutput:
        grads = {k: as_float64(p.grad.numpy()) for k, p in self.params.items() if self.spec.train}
        return StepOutput(as_float64(self.value.detach().numpy()), grads)

    def saved_bytes(self) -> SavedBytes | None:
        """Unique storages packed by saved_tensors_hooks during one forward."""
        if not self.spec.train:
            return None
        storages = {}

        def pack(t):
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
            return t

        with self.torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            value = self.fn(self.params, *self.batch)
        value.backward()
        inputs = [*self.params.values(), *self.batch]
        input_ptrs = {t.untyped_storage().data_ptr() for t in inputs}
        own = sum(n for ptr, n in storages.items() if ptr not in input_ptrs)
        return SavedBytes(own, sum(storages.values()), "saved_tensors_hooks, unique storages")


class TorchPeer(Peer):
    name = "torch"
    family = "torch"
    description = "PyTorch eager"
    compiled = False

    def missing(self) -> str | None:
        if importlib.util.find_spec("torch") is None:
            return "torch is not installed (pip install 'backplan[peers]')"
        return None

    def versions(self) -> dict[str, str]:
        import torch

        return {"torch": torch.__version__}

    def build(self, spec: ModelSpec, inputs: ModelInputs) -> Runner:
        return TorchRunner(spec, inputs, compiled=self.compiled)


class TorchCompilePeer(TorchPeer):
    name = "torch.compile"
    description = "torch.compile (inductor) forward, compiled backward via AOTAutograd"
    warm_first_call = "after torch.compiler.reset(): compile again with inductor's caches warm"
    compiled = True

    def clear_caches(self) -> None:
        import torch

        torch.compiler.reset()

    def build(self, spec: ModelSpec, inputs: ModelInputs) -> Runner:
        """Every model's wrapper shares one code object, so without a reset Dynamo would see
        the next model as a shape change of the last and compile it with dynamic shapes; a
        program compiling one model would not."""
        self.clear_caches()
        return super().build(spec, inputs)
