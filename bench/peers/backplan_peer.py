"""backplan itself, through its public API only: `bp.value_and_grad` (one joint plan) and
`@bp.compile` followed by `.backward()`. Plan facts (saved buffers, peak bytes, kernels) come
from `bp.explain`, so they hold for whichever backend runs the plans."""

from __future__ import annotations

import backplan as bp

from ..models import BACKPLAN_KINDS, ModelInputs, ModelSpec
from .base import Peer, Runner, SavedBytes, StepOutput, as_float64


def bench_function(spec: ModelSpec):
    """The model's backplan function with its static arguments bound: loss(params, *batch) for
    training models, forward(params, *inputs) for forward-only ones."""
    loss_fn, forward_fn = BACKPLAN_KINDS[spec.kind]
    fn, static = (loss_fn if spec.train else forward_fn), spec.static

    def model(params, *batch):
        return fn(params, *batch, **static)

    model.__name__ = model.__qualname__ = spec.name
    return model


def _tensors(spec: ModelSpec, inputs: ModelInputs, requires_grad: bool):
    params = {k: bp.tensor(v, requires_grad=requires_grad) for k, v in inputs.params.items()}
    return params, [bp.tensor(a) for a in inputs.batch(spec.train)]


class PlanFacts(Runner):
    """Saved bytes, planned peak and kernels from `bp.explain`, the public report of the
    plans this runner's function traced to."""

    def explain(self):
        return bp.explain(self.fn, self.params, *self.batch)

    def saved_bytes(self) -> SavedBytes | None:
        if not self.spec.train:
            return None
        report = self.explain()
        return SavedBytes(
            report.saved_bytes - report.saved_input_bytes,
            report.saved_bytes,
            "bp.explain saved_bytes",
        )

    def planned_peak_bytes(self):
        what = (
            "bp.explain peak_bytes (whole step, arrays passed in included, the last "
            "step's results held until the call returns, as the timed loop holds them)"
        )
        return self.explain().peak_bytes, what

    def counted_peak_bytes(self) -> dict | None:
        """The step's peak as the checked mode counts it (BACKPLAN_CHECK_MEMORY=1): a twin
        runner whose compiled plans pass every buffer they allocate or use (arenas, outputs,
        constants) through one counting allocator, its third step measured as the harness
        times it, in the loop users write: the second step's results stay bound until the
        third returns (the first step compiles, the second runs a driver built in the
        background; a buffer a plan does not predict raises MemoryCheckError). Compared with
        explain's peak for that call in such a loop, report.loop_peak_on_call(3) (a small
        compile + backward() step runs one joint plan from its third call,
        runtime/joint_step.py). What that allocator cannot see, the arrays passed in and a
        conv kernel's own im2col columns, is taken from the prediction (peak_bytes -
        allocated_peak_bytes). `held` names the buffers counted at the peak and `left_alive`
        the bytes the earlier steps left alive, so that a mismatch says what the plan left
        out. None where no compiled plan runs (the reference interpreter)."""
        from backplan.bench.internals import checked_memory, measure, wait_for_builds

        peak = self.explain().loop_peak_on_call(3)
        if peak.backend != "numba":
            return None
        with checked_memory(), measure() as measured:  # open across the steps: what earlier
            twin = self.twin()  # steps left alive (the arenas of plans not run now) counts too
            twin.step()
            wait_for_builds()  # a driver built in the background runs from the next step
            twin.step()
            measured.restart_peak()
            left = measured.live  # what the earlier steps left alive (arenas, last results)
            twin.step()
        if measured.peak == 0:  # no plan of the twin was built in the checked mode
            return None
        return {
            "bytes": measured.peak + peak.peak_bytes - peak.allocated_peak_bytes,
            "counted": measured.peak,
            "predicted": peak.allocated_peak_bytes,
            "held": dict(measured.at_peak),  # buffer name -> bytes at the counted peak
            "left_alive": left,
        }

    def twin(self):
        """A new runner of the same model and inputs, tracing and compiling afresh."""
        return type(self)(self.spec, self.inputs, background=False)

    def plan_facts(self) -> dict | None:
        report = self.explain()
        return {
            "backend": report.backend,
            "kernels": report.n_kernels,
            "fused_kernels": report.fused_kernels,
        }


class ValueAndGradRunner(PlanFacts):
    """step = bp.value_and_grad(loss, argnums=0)(params, *batch): one joint plan."""

    # Both backends allocate step arrays through NumPy, but tracemalloc sees none of what
    # compiled kernels use (arenas kept between steps, outputs): counted_peak_bytes counts it.
    numpy_allocations = True

    def __init__(self, spec: ModelSpec, inputs: ModelInputs, background: bool | None = None):
        self.spec, self.inputs = spec, inputs
        self.params, self.batch = _tensors(spec, inputs, requires_grad=False)
        self.fn = bp.value_and_grad(bench_function(spec), argnums=0, background=background)
        self.result = None

    def step(self) -> None:
        self.result = self.fn(self.params, *self.batch)

    def output(self) -> StepOutput:
        value, grads = self.result
        return StepOutput(
            as_float64(value.numpy()), {k: as_float64(g.numpy()) for k, g in grads.items()}
        )


class CompileRunner(PlanFacts):
    """step = loss = compiled(params, *batch); loss.backward(). Forward-only models run the
    compiled forward with no parameter requiring grad."""

    numpy_allocations = True

    def __init__(self, spec: ModelSpec, inputs: ModelInputs, background: bool | None = None):
        self.spec, self.inputs = spec, inputs
        self.params, self.batch = _tensors(spec, inputs, requires_grad=spec.train)
        self.fn = bp.compile(bench_function(spec), background=background)
        self.value = None

    def step(self) -> None:
        if not self.spec.train:
            self.value = self.fn(self.params, *self.batch)
            return
        bp.zero_grad(self.params)
        self.value = self.fn(self.params, *self.batch)
        self.value.backward()

    def output(self) -> StepOutput:
        grads = {k: as_float64(p.grad.numpy()) for k, p in self.params.items() if self.spec.train}
        return StepOutput(as_float64(self.value.numpy()), grads)


class BackplanPeer(Peer):
    name = "backplan"
    family = "backplan"
    description = "bp.value_and_grad(loss, argnums=0): one joint forward+backward plan"
    warm_first_call = (
        "a new traced function: trace and plan again; kernels compiled earlier "
        "in this process are reused (backplan has no public cache reset)"
    )

    def versions(self) -> dict[str, str]:
        return {"backplan": bp.__version__}

    def build(self, spec: ModelSpec, inputs: ModelInputs) -> Runner:
        if not spec.train:
            return CompileRunner(spec, inputs)
        return ValueAndGradRunner(spec, inputs)


class BackplanBackgroundPeer(BackplanPeer):
    """value_and_grad(background=True): the first calls run on the reference interpreter while
    a background process compiles the plans, so no call waits for a compiler."""

    name = "backplan.background"
    description = "bp.value_and_grad(loss, argnums=0, background=True)"

    def build(self, spec: ModelSpec, inputs: ModelInputs) -> Runner:
        if not spec.train:
            return CompileRunner(spec, inputs, background=True)
        return ValueAndGradRunner(spec, inputs, background=True)


class BackplanReferencePeer(BackplanPeer):
    """value_and_grad with plans run by the NumPy reference interpreter: shows what the
    default backend gains over it. Needs backplan's backend switch."""

    name = "backplan.reference"
    description = "bp.value_and_grad on the NumPy reference interpreter"
    warm_first_call = "a new traced function: trace and plan again (nothing to compile)"

    def missing(self) -> str | None:
        try:
            from backplan.bench.internals import use_backend  # noqa: F401
        except ImportError:
            return "this backplan has no backend switch (runtime.backend.use_backend)"
        return None

    def build(self, spec: ModelSpec, inputs: ModelInputs) -> Runner:
        return OnBackend(super().build(spec, inputs), "reference")


class OnBackend(Runner):
    """Runs another runner's steps with a given backend current, so its plans get runners
    of that backend when they first run."""

    numpy_allocations = True

    def __init__(self, runner: Runner, backend: str):
        from backplan.bench.internals import use_backend

        self.runner, self.use_backend, self.backend = runner, use_backend, backend

    def step(self) -> None:
        with self.use_backend(self.backend):
            self.runner.step()

    def output(self) -> StepOutput:
        return self.runner.output()

    def saved_bytes(self) -> SavedBytes | None:
        with self.use_backend(self.backend):
            return self.runner.saved_bytes()

    def planned_peak_bytes(self):
        with self.use_backend(self.backend):
            return self.runner.planned_peak_bytes()

    def plan_facts(self) -> dict | None:
        with self.use_backend(self.backend):
            return self.runner.plan_facts()

    def counted_peak_bytes(self) -> dict | None:
        with self.use_backend(self.backend):
            return self.runner.counted_peak_bytes()


class BackplanCompilePeer(Peer):
    name = "backplan.compile"
    family = "backplan"
    description = "@bp.compile forward, then loss.backward() through the saved-buffer plan"
    warm_first_call = BackplanPeer.warm_first_call

    def skip_reason(self, spec: ModelSpec) -> str | None:
        if not spec.train:
            return "forward only: the same compiled path as the backplan row"
        return None

    def build(self, spec: ModelSpec, inputs: ModelInputs) -> Runner:
        return CompileRunner(spec, inputs)
