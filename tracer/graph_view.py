"""`t.graph()` / `bp.explain_graph(t)`: the tensor-side entry to report/graph.py."""

from __future__ import annotations

from backplan.report.graph import GraphReport, graph_report

from .errors import TracingError
from .source import loc_text, user_frame_loc


def explain_graph(tensor) -> GraphReport:
    """Every region `tensor.backward()` would run, in order: each saved buffer with its bytes,
    the line that produced it, the backward steps that read it and whether it is alive or
    freed (and by which backward()), then the total. Eager ops and compiled calls alike.

    >>> import backplan as bp
    >>> a = bp.tensor([1.0, 2.0], requires_grad=True)
    >>> o = bp.sum(bp.tanh(a) * 5)
    >>> report = o.graph()
    >>> [r.name for r in report.regions], report.saved_bytes
    (['sum', 'mul', 'tanh'], 8)
    """
    from .tensor import Tensor

    if not isinstance(tensor, Tensor):
        raise TypeError(f"explain_graph() takes a tensor, got {type(tensor).__name__}")
    if tensor._data is None:
        raise TracingError(
            f"graph() of a traced tensor at {loc_text(user_frame_loc())}: inside @compile there "
            "is no graph yet; call it on the compiled function's output, or use fn.explain()"
        )
    return graph_report(tensor._grad_fn, tensor._out_index, tensor.requires_grad)
