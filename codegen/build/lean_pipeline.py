"""A shorter Numba pipeline for the loop kernels backplan generates.

Numba's default pipeline serves any Python function: closures, `with` blocks, literal
unrolling, generators, array expressions, dead branches and the rewrites that find them. A
generated loop kernel has none of these: straight-line setup, `range` loops, arithmetic, calls
to intrinsics and to scalar functions. Each of those passes still walks the whole IR, so a cold
plan of twenty kernels paid for them twenty times. This pipeline keeps what turns bytecode into
typed, lowered code and nothing else:

    bytecode -> IR -> inline 'always' callees -> SSA -> types -> strip phis -> lower

It is used only by generated kernels (codegen/render/kernel_source.py); a construct the pipeline
does not handle fails to type or lower with Numba's own error, which every generated form is tested
against (tests/test_codegen.py compiles every registry op).
"""

from numba.core.compiler import CompilerBase
from numba.core.compiler_machinery import PassManager
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
