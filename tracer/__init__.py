"""backplan.tracer: Tensor, the op functions, pytrees, tracing and the signature cache."""

from . import methods  # noqa: F401  (installs Tensor operators)
from .compile import CompiledFunction, compile
from .errors import TracingError
from .functional import grad, value_and_grad
from .tensor import Tensor

__all__ = ["CompiledFunction", "compile", "TracingError", "grad", "value_and_grad", "Tensor"]
