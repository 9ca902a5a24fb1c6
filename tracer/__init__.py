"""backplan.tracer: Tensor, the op functions, pytrees, tracing and the signature cache."""

from .compile import CompiledFunction, compile
from .errors import TracingError
from .functional import grad, value_and_grad
from .methods import install_tensor_methods
from .tensor import Tensor

install_tensor_methods()  # operators and op methods; tensor.py cannot import the ops

__all__ = ["CompiledFunction", "compile", "TracingError", "grad", "value_and_grad", "Tensor"]
