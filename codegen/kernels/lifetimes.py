"""keep_alive: hold arrays until a point of compiled code after their addresses were taken.

Numba releases an array after the last statement that names it. Code that passes an array's
address (`.ctypes.data`) to a function taking integers names the array for the last time when
it takes the address: a temporary (a copy made for the call, a workspace) was freed before the
callee read it. A call of keep_alive((a, b, c)) after the call names them again; it compiles to
nothing.
"""

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


if AS_PYTHON:

    def keep_alive(arrays):  # noqa: F811 - Python keeps its references itself
        return None
