"""How LLVM optimises the loops a driver running as Python calls (codegen/run/address_calls.py).

Those loops run only until the plan's compiled driver loads (its own copies of the loops are
optimised in full), so what they need is to compile fast and run about as fast. Numba runs
function passes with a new pass manager per function, then a cheap and a full level-3 module
pipeline with the loop vectoriser interleaving and unrolling what it vectorised; most of a cold
kernel's LLVM time goes there and into emitting what it leaves. Here each loop's module is
optimised once:

- ADDRESS_LOOP, a loop over many elements: level 2, loops vectorised but not interleaved or
  unrolled, no SLP vectoriser. Cold first calls, one pinned CPU: transformer 2.1-2.6 -> 1.7 s,
  deep MLP 1.3-1.5 -> 1.2-1.3 s; the steps these loops run as fast (73-81 ms, 12 ms).
- INTERLEAVED_LOOP, an ADDRESS_LOOP that converts 16-bit values (bfloat16, float16) or sums
  into a scalar (a row's sum or variance, a loss): the same, with the loop vectoriser
  interleaving. Its sums and the conversions' integer chains then keep more than one vector in
  flight: the bench ln_gelu's bf16 forward-and-backward loop ran 2.85 -> 2.2 ms (level 3 alone:
  2.80, unrolling alone: 2.86), and its Python-run step 0.76x -> 0.6x the float32 one
  (BENCHMARKS.md, 33); the float32 loop, whose row sums had one vector add in flight, 4.39 ->
  4.23 ms (1.24x -> 1.20x the hand-fused loop, thread CPU, one Zen 5 core; BENCHMARKS.md, 36),
  compiled in 0.215 CPU s against 0.207 (the cost model leaves its GELU loop at one vector).
  Loops that sum nothing into a scalar keep ADDRESS_LOOP, so their compile is unchanged.
- DRIVER, a compiled driver whose loops are called by address (codegen/build/loop_calls.py):
  level 1, nothing vectorised: its code is argument conversions and calls, with no loop for
  the level-3 pipeline to improve (BENCHMARKS.md, 31).
- SMALL_LOOP, a loop over at most SMALL_LOOP_ELEMENTS (codegen/flags.py): level 1, nothing
  vectorised. A cold unrolled LSTM (loops of 128-512 elements) compiled its kernels about 30%
  faster, at the same step time.
"""

from dataclasses import dataclass

from llvmlite import binding as llvm
from numba.core.codegen import JITCodeLibrary
from numba.core.compiler import CompilerBase, DefaultPassBuilder
from numba.core.compiler_machinery import register_pass
from numba.core.typed_passes import NativeLowering

from backplan.codegen.build.lean_pipeline import LeanKernelCompiler


@dataclass(frozen=True)
class Optimisation:
    level: int
    vectorise_loops: bool
    interleave_loops: bool = False
    unroll_and_slp: bool = False  # loops of constant trip counts unrolled, then SLP-vectorised


ADDRESS_LOOP = Optimisation(level=2, vectorise_loops=True)
INTERLEAVED_LOOP = Optimisation(level=2, vectorise_loops=True, interleave_loops=True)
SMALL_LOOP = Optimisation(level=1, vectorise_loops=False)
DRIVER = Optimisation(level=1, vectorise_loops=False)
# A loop compiled at constant sizes whose outer loop steps over 16 elements or more
# (codegen/build/direct_loops.py): unrolled and SLP-vectorised, not loop-vectorised (LLVM
# vectorises such an outer loop with gathers, up to 2x slower there than scalar code).
UNROLLED_LOOP = Optimisation(level=3, vectorise_loops=False, unroll_and_slp=True)


def _library_class(optimisation: Optimisation) -> type:
    class Library(JITCodeLibrary):
        def _optimize_functions(self, ll_module):
            ll_module.data_layout = self._codegen._data_layout  # the module pipeline does the rest

        def _optimize_final_module(self):
            tuning = llvm.create_pipeline_tuning_options()
            tuning.speed_level = optimisation.level
            tuning.loop_vectorization = optimisation.vectorise_loops
            tuning.slp_vectorization = optimisation.unroll_and_slp
            tuning.loop_interleaving = optimisation.interleave_loops
            tuning.loop_unrolling = optimisation.unroll_and_slp
            builder = llvm.create_pass_builder(self._codegen._tm, tuning)
            builder.getModulePassManager().run(self._final_module, builder)

    kind = "Interleaved" * optimisation.interleave_loops + "Unrolled" * optimisation.unroll_and_slp
    name = f"Level{optimisation.level}{kind}CodeLibrary"
    Library.__name__ = Library.__qualname__ = name
    return Library


def _compiler(optimisation: Optimisation, name: str) -> type:
    """LeanKernelCompiler, lowering into a library optimised as `optimisation` says."""
    library_class = _library_class(optimisation)

    @register_pass(mutates_CFG=True, analysis_only=False)
    class Lowering(NativeLowering):
        _name = f"backplan_{name}_native_lowering"

        def run_pass(self, state):
            if state.library is None:
                codegen = state.targetctx.codegen()
                state.library = library_class(codegen, state.func_id.func_qualname)
                state.library.enable_object_caching()
            return super().run_pass(state)

    return type(
        f"{name.title().replace('_', '')}Compiler",
        (LeanKernelCompiler,),
        {"lowering_pass": Lowering},
    )


AddressLoopCompiler = _compiler(ADDRESS_LOOP, "address_loop")
InterleavedLoopCompiler = _compiler(INTERLEAVED_LOOP, "interleaved_loop")
SmallLoopCompiler = _compiler(SMALL_LOOP, "small_loop")
UnrolledLoopCompiler = _compiler(UNROLLED_LOOP, "unrolled_loop")
# How each loop pipeline optimises (codegen/build/loop_batch.py lowers a plan's loops into one
# library per entry).
LOOP_OPTIMISATIONS = {
    AddressLoopCompiler: ADDRESS_LOOP,
    InterleavedLoopCompiler: INTERLEAVED_LOOP,
    SmallLoopCompiler: SMALL_LOOP,
}


def _full_pipeline_compiler(optimisation: Optimisation, name: str) -> type:
    """Numba's whole nopython pipeline (a driver raises with formatted messages, which the
    lean one does not type), lowering into a library optimised as `optimisation` says."""
    lowering = _compiler(optimisation, name).lowering_pass

    class Compiler(CompilerBase):
        def define_pipelines(self):
            manager = DefaultPassBuilder.define_nopython_pipeline(self.state)
            manager.passes = [
                (lowering if kind is NativeLowering else kind, what)
                for kind, what in manager.passes
            ]
            return [manager]

    Compiler.__name__ = Compiler.__qualname__ = f"{name.title().replace('_', '')}Compiler"
    return Compiler


DriverCompiler = _full_pipeline_compiler(DRIVER, "address_driver")
# The code library of a driver emitted without Numba's pipeline (codegen/build/direct_driver.py).
DriverLibrary = _library_class(DRIVER)
