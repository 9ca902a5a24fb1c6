"""backplan.from_torch: the torch peer's model written as a torch.nn.Module, imported with
`bp.from_torch` and stepped by backplan. It sits in each model's table beside PyTorch eager and
torch.compile running the same functions over the same parameters at the same threads, and its
cold first call is the import plus the first step, beside torch.compile's capture and compile."""

from __future__ import annotations

import backplan as bp

from ..measure import timed
from ..models import ModelInputs, ModelSpec
from .backplan_peer import PlanFacts
from .base import StepOutput, as_float64
from .torch_peer import TorchPeer

PREFIX = "p."  # the module keeps the bench parameters in a ParameterDict named p


def module_of(spec: ModelSpec, params: dict):
    """The torch peer's function of `spec` (its loss, or its forward for a forward-only
    model) as a Module holding copies of `params` (NumPy arrays) as its parameters."""
    import torch

    from .torch_models import TORCH_KINDS

    loss_fn, forward_fn = TORCH_KINDS[spec.kind]
    fn = loss_fn if spec.train else forward_fn

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.p = torch.nn.ParameterDict(
                {k: torch.nn.Parameter(torch.from_numpy(v.copy())) for k, v in params.items()}
            )

        def forward(self, *batch):
            return fn(dict(self.p), *batch, **spec.static)

    Model.__name__ = f"{spec.name}_module"
    return Model() if spec.train else Model().eval()


class ImportedRunner(PlanFacts):
    """The first step imports the module (torch.export, the ATen mapping) and then runs it, so
    the row's cold first call is import + first call; later steps run
    bp.value_and_grad(fn)(params, *batch), or the compiled forward of a forward-only model."""

    numpy_allocations = True

    def __init__(self, spec: ModelSpec, inputs: ModelInputs):
        import torch

        self.spec, self.fn, self.result, self.import_s = spec, None, None, None
        self.inputs = inputs
        self.module = module_of(spec, inputs.params)
        self.batch = inputs.batch(spec.train)
        self.example = tuple(torch.from_numpy(a.copy()) for a in self.batch)

    def _import(self) -> None:
        self.import_s, (imported, self.params) = timed(
            lambda: bp.from_torch(self.module, self.example)
        )
        if not self.spec.train:
            self.fn = bp.compile(imported)
            return

        def step(params, *batch):
            return imported(params, *batch)

        step.__name__ = step.__qualname__ = self.spec.name
        self.fn = bp.value_and_grad(step, argnums=0)

    def step(self) -> None:
        if self.fn is None:
            self._import()
        self.result = self.fn(self.params, *self.batch)

    def twin(self):
        return ImportedRunner(self.spec, self.inputs)

    def first_call_parts(self) -> dict:
        return {"import": self.import_s}

    def output(self) -> StepOutput:
        if not self.spec.train:
            return StepOutput(as_float64(self.result.numpy()), {})
        value, grads = self.result
        return StepOutput(
            as_float64(value.numpy()),
            {k.removeprefix(PREFIX): as_float64(g.numpy()) for k, g in grads.items()},
        )


class ImportedTorchPeer(TorchPeer):
    """Runs wherever torch does (it needs torch to export the module); backplan's family, so
    its steps are timed once backplan's compiled drivers run, as the other backplan rows."""

    name = "backplan.from_torch"
    family = "backplan"
    description = (
        "bp.from_torch(the torch peer's model as an nn.Module), then bp.value_and_grad: "
        "the imported step compiled by backplan"
    )
    warm_first_call = "a new import of the same module (torch.export and tracing again)"

    def missing(self) -> str | None:
        if super().missing():
            return "torch is not installed (pip install 'backplan[torch]')"
        return None

    def versions(self) -> dict[str, str]:
        return {}

    def build(self, spec: ModelSpec, inputs: ModelInputs) -> ImportedRunner:
        return ImportedRunner(spec, inputs)
