"""A shorter Numba pipeline for the loop kernels backplan generates.

Numba's default pipeline serves any Python function: closures, `with` blocks, literal
unrolling, generators, array expressions, dead branches and the rewrites that find them. A
generated loop kernel has none of these: straight-line setup, `range` loops, arithmetic, calls
to intrinsics and to scalar functions. Each of those passes still walks the whole IR, so a cold
plan of twenty kernels paid for them twenty times. This pipeline keeps what turns bytecode into
typed, lowered code and nothing else:

    bytecode -> IR -> inline 'always' callees -> SSA -> types -> strip phis -> lower

It is used only by generated kernels (codegen/kernel_source.py); a construct the pipeline does
not handle fails to type or lower with Numba's own error, which every generated form is tested
against (tests/test_codegen.py compiles every registry op).
"""

from numba.core.codegen import JITCodeLibrary
from numba.core.compiler import CompilerBase
from numba.core.compiler_machinery import PassManager, register_pass
from numba.core.typed_passes import (
    NativeLowering,
    NoPythonBackend,
    NopythonTypeInference,
    PreLowerStripPhis,
)
from numba.core.untyped_passes import (
    FixupArgs,
    InlineInlinables,
    IRProcessing,
    ReconstructSSA,
    TranslateByteCode,
)


class LeanKernelCompiler(CompilerBase):
    """Numba's nopython pipeline less the passes generated kernels never need."""

    lowering_pass = NativeLowering

    def define_pipelines(self):
        manager = PassManager("backplan_kernel")
        manager.add_pass(TranslateByteCode, "analyzing bytecode")
        manager.add_pass(FixupArgs, "fix up args")
        manager.add_pass(IRProcessing, "processing IR")
        manager.add_pass(InlineInlinables, "inline scalar functions marked inline='always'")
        manager.add_pass(ReconstructSSA, "ssa")
        manager.add_pass(NopythonTypeInference, "nopython frontend")
        manager.add_pass(PreLowerStripPhis, "remove phis nodes")
        manager.add_pass(self.lowering_pass, "native lowering")
        manager.add_pass(NoPythonBackend, "nopython mode backend")
        manager.finalize()
        return [manager]


# Small loops: LLVM's optimisation level for a loop too small to gain from vectorising. Most of
# a cold kernel's LLVM time is the loop vectoriser and what it leaves to emit (interleaved
# vector bodies, runtime checks, scalar remainders); at level 1 without it a cold unrolled LSTM
# (loops of 128-512 elements) compiled its kernels about 30% faster at the same step time.
QUICK_OPT_LEVEL = 1


class QuickCodeLibrary(JITCodeLibrary):
    """A code library optimised once, at level 1, without vectorisers. Numba's runs function
    passes with a fresh pass manager per function, then a cheap and a full module pipeline."""

    def _optimize_functions(self, ll_module):
        ll_module.data_layout = self._codegen._data_layout

    def _optimize_final_module(self):
        manager, builder = self._codegen._module_pass_manager(
            opt=QUICK_OPT_LEVEL, loop_vectorize=False, slp_vectorize=False
        )
        manager.run(self._final_module, builder)


@register_pass(mutates_CFG=True, analysis_only=False)
class QuickNativeLowering(NativeLowering):
    """Numba's lowering into a QuickCodeLibrary."""

    _name = "backplan_quick_native_lowering"

    def run_pass(self, state):
        if state.library is None:
            state.library = QuickCodeLibrary(state.targetctx.codegen(), state.func_id.func_qualname)
            state.library.enable_object_caching()
        return super().run_pass(state)


class QuickKernelCompiler(LeanKernelCompiler):
    """The lean pipeline, lowered into a QuickCodeLibrary: for loops over few elements."""

    lowering_pass = QuickNativeLowering
