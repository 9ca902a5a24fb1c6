"""from_torch: a torch.nn.Module as (fn, params), fn a plain backplan function of
(params, *args) that bp.compile, bp.value_and_grad, bp.optim, explain and export take like any
hand-written one."""

from __future__ import annotations

import torch

from .capture import capture, refuse_dynamic_shapes, refuse_mutations, refuse_unmapped
from .program import ImportedGraph
from .state import parameters


def from_torch(module: torch.nn.Module, example_args, example_kwargs=None):
    """Import `module` as `fn, params = from_torch(module, (x,))`.

    `params` is {state_dict name: tensor} (parameters share memory with the module's through
    DLPack). `fn(params, *args, key=None, **kwargs)` computes module(*args, **kwargs) with
    backplan ops for inputs of the example's shapes and dtypes. A module in training mode
    with dropout draws from `key`; one whose batch norm updates running statistics returns
    `(output, new_buffers)`, new_buffers {state_dict name: tensor}. Every op without a
    mapping is named in one error, each with its module path and source line."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"from_torch: expected a torch.nn.Module, got {type(module).__name__}")
    args = tuple(example_args) if isinstance(example_args, list | tuple) else (example_args,)
    owner = type(module).__name__
    program = capture(module, args, dict(example_kwargs or {}))
    refuse_dynamic_shapes(program, owner)
    refuse_unmapped(program, owner)
    refuse_mutations(program, module, owner)
    graph = ImportedGraph(program, module, owner)

    def fn(params, *args, key=None, **kwargs):
        return graph.run(params, args, kwargs, key)

    fn.__name__ = fn.__qualname__ = f"{owner}_forward"
    fn.__doc__ = f"{owner}.forward imported from PyTorch: fn(params, *args, key=None)."
    fn.imported = graph  # type: ignore[attr-defined]
    fn.parameter_names = tuple(n for n, p in module.named_parameters())  # type: ignore[attr-defined]
    fn.buffer_names = tuple(n for n in graph.expected if n not in fn.parameter_names)  # type: ignore[attr-defined]
    return fn, parameters(module)
