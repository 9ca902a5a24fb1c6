"""explain(): the plan of a step as text, graph and picture, before anything runs."""

from __future__ import annotations

from backplan.ir.errors import BackplanError
from backplan.report.report import ExplainReport

from .compile import CompiledFunction


def explain(fn, *args, **kwargs) -> ExplainReport:
    """Trace fn for these arguments and report its plans, without running the model's arithmetic.

    fn is a `bp.compile`d function, a `bp.value_and_grad` / `bp.grad` of one, or a plain
    function (compiled here). `print(report)` shows the summary, the forward and backward IR,
    the saved buffers and why each is saved (and the values recomputed instead), the memory
    each path holds, the kernels and the last retrace; the numbers are fields (`saved_bytes`,
    `peak_bytes`, `saved_buffers`, `recomputed`, `compiled`, `forward_ir`, `backward_ir`);
    `report.to_dot()` and `report.plot("step.png")` draw it. Under the numba backend the
    compiled plans' layout comes from source generation alone: nothing is compiled.

    >>> import backplan as bp
    >>> a = bp.tensor([1.0, 2.0], requires_grad=True)
    >>> report = bp.explain(lambda a, b: (a * b).sum(), a, bp.tensor([3.0, 4.0]))
    >>> [(s.name, s.reason) for s in report.saved_buffers]
    [('b', 'mul derivative reads input 1')]
    """
    method = getattr(fn, "explain", None)
    if callable(method):
        return method(*args, **kwargs)
    if not callable(fn):
        raise BackplanError(f"explain() needs a function, got {type(fn).__name__}")
    return CompiledFunction(fn).explain(*args, **kwargs)
