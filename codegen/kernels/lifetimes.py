"""keep_alive: hold arrays until a point of compiled code after their addresses were taken;
keep_value: a value computed although nothing reads it.

Numba releases an array after the last statement that names it. Code that passes an array's
address (`.ctypes.data`) to a function taking integers names the array for the last time when
it takes the address: a temporary (a copy made for the call, a workspace) was freed before the
callee read it. A call of keep_alive((a, b, c)) after the call names them again; it compiles to
nothing.
"""

from llvmlite import ir
from numba import types
from numba.core.extending import intrinsic

from backplan.codegen.jit import AS_PYTHON


@intrinsic
def keep_alive(typingctx, arrays):
    """Nothing, at run time; the arrays in the tuple live until here."""
    if not isinstance(arrays, types.BaseTuple):
        return None

    def codegen(context, builder, signature, args):
        return context.get_dummy_value()

    return types.none(arrays), codegen


@intrinsic
def keep_value(typingctx, value):
    """Nothing, at run time, but the float `value` (and the reads it sums) is computed: an
    empty asm statement takes its bits. For reads made for their effect on the caches
    (gemm/driver.touch_rows), which the optimiser would otherwise drop."""
    if not isinstance(value, types.Float):
        return None

    def codegen(context, builder, signature, args):
        (x,) = args
        bits = ir.IntType(64 if isinstance(x.type, ir.DoubleType) else 32)
        use = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [bits]), "", "r", side_effect=True)
        builder.call(use, [builder.bitcast(x, bits)])
        return context.get_dummy_value()

    return types.none(value), codegen


if AS_PYTHON:

    def keep_alive(arrays):  # noqa: F811 - Python keeps its references itself
        return None

    def keep_value(value):  # noqa: F811
        return None
