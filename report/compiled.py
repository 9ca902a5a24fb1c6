"""What the numba backend's compiled plans will hold, for explain(): per plan, its kernels, the
scratch arena it keeps and reuses on every call, and the bytes it allocates fresh per call (what
the call returns). The numbers are the lowered plan's (`backplan.ir.lowering.lower`, computed
once per plan and shared with the code generator), donations included (`lowered.donations`).
Kernel hashes and compile estimates are facts of the rendered source: they are read from the
lowered plan's one rendering (`lowered.rendered`), which explain makes only when no runner has
made it yet (explain before the first call) and which the compiled plan then reuses. On the
reference backend explain reads none of this and renders nothing. Nothing is compiled."""

from __future__ import annotations

from dataclasses import dataclass, replace

from backplan.codegen.build import kernel_cache
from backplan.codegen.build.progress import driver_seconds, estimate, fresh_twins
from backplan.codegen.kernels.gemm.packing import planned_packing
from backplan.codegen.render.emit import generate
from backplan.codegen.render.opaque import unsupported_reason
from backplan.codegen.run.compiled import output_buffers, returning_outputs
from backplan.codegen.run.workspace import reused_output_bytes
from backplan.ir.donation import donated_outputs
from backplan.ir.liveness import Plan
from backplan.ir.lowering import lower

from .plan_view import input_label


@dataclass(frozen=True)
class CompiledPlanFacts:
    """One plan as the numba backend will run it."""

    plan: str  # "forward", "backward (consume)", "backward (retain)" or "joint"
    kernels: int = 0  # kernels that run code (fused loops and single ops)
    scratch_bytes: int = 0  # arena kept by the compiled plan, reused on every call
    output_bytes: int = 0  # allocated fresh on every call: what the call returns
    reused_saved: int = 0  # temporaries placed in saved buffers after their last read
    unsupported: str | None = None  # why this plan would run on the reference interpreter
    loop_kernels: tuple[str, ...] = ()  # hashes of the distinct shared loop kernels it calls
    cached_kernels: tuple[str, ...] = ()  # those already compiled (this process or on disk)
    compile_seconds: float = 0.0  # predicted compile time: every loop kernel and the driver
    driver_seconds: float = 0.0  # of which the driver's (in the background by default)
    donated: tuple = ()  # (output index, donated input (index, or name), bytes): in place
    # pages of backplan's GEMM packing buffers its products write, kept by the process and
    # counted in the peak (codegen/kernels/gemm/packing.py): all of them, and (the calling
    # thread's, each helper's, helpers) where a product is shared between threads
    packing_bytes: int = 0
    packing_threads: tuple = (0, 0, 0)
    # one generation of its large outputs, kept between calls to write the next call's into
    # (codegen/run/workspace.py): resident beside the results a loop holds
    reused_output_bytes: int = 0

    @property
    def compiled(self) -> bool:
        return self.unsupported is None


def one_listing():
    """A report's questions about which kernels are cached answered from one listing of the
    kernel folder (codegen/build/kernel_cache.py one_listing): explain asks for every plan."""
    return kernel_cache.one_listing()


def plan_facts(label: str, plan: Plan, private_saved: tuple[int, ...] = ()) -> CompiledPlanFacts:
    """Outputs written into the inputs the plan donates allocate nothing fresh per call."""
    lowered = lower(plan, private_saved)
    why = unsupported_reason(lowered)
    if why is not None:
        return CompiledPlanFacts(label, unsupported=why)
    layout = lowered.layout
    generated = generate(lowered)  # source only: cheap, nothing compiled
    kernels = generated.loop_kernels
    in_place = donated_outputs(lowered)
    buffers = output_buffers(generated)
    packing = planned_packing(lowered)
    reused = reused_output_bytes(buffers, returning_outputs(plan.graph, buffers, lowered.donations))
    cached = kernel_cache.cached_digests(kernels)
    return CompiledPlanFacts(
        label,
        generated.kernel_count,
        layout.scratch_bytes,
        layout.output_bytes - sum(n for _, _, n in in_place),
        len(layout.reused_saved),
        loop_kernels=tuple(k.digest for k in kernels),
        cached_kernels=tuple(k.digest for k in kernels if k.digest in cached),
        compile_seconds=estimate(kernels, False, generated.driver_statements).seconds,
        driver_seconds=driver_seconds(generated.driver_statements, fresh_twins(kernels)),
        donated=tuple(in_place),
        packing_bytes=packing.nbytes,
        packing_threads=(*packing.per_thread, packing.helpers),
        reused_output_bytes=reused,
    )


def region_facts(program) -> list[CompiledPlanFacts]:
    """The forward, then both backward variants: backward() consumes the graph (and may reuse
    its private saved buffers as scratch), backward(retain_graph=True) keeps them intact."""
    plans = program.plans
    forward = plan_facts("forward", plans.forward)
    named = tuple((out, input_label(program.input_names, i), n) for out, i, n in forward.donated)
    facts = [replace(forward, donated=named)]
    if plans.backward is not None:
        facts.append(
            plan_facts("backward (consume)", plans.backward, program.private_saved_inputs())
        )
        facts.append(plan_facts("backward (retain)", plans.backward))
    return facts


def joint_facts(plan: Plan) -> list[CompiledPlanFacts]:
    return [plan_facts("joint", plan)]
