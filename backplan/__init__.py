"""backplan: compile numerical model functions into static forward and backward plans whose
saved buffers, lifetimes and frees are known before anything runs.

>>> import backplan as bp
>>> x = bp.tensor([1.0, -2.0], requires_grad=True)
>>> y = bp.tanh(x).sum()
>>> [b.name for b in y.grad_fn.saved_buffers] if y.grad_fn else []
[]
"""

from numpy import bool_, float16, float32, float64, int32, int64, uint8  # bp.float32, as jnp

try:
    from ml_dtypes import bfloat16  # the NumPy dtype JAX uses: a storage dtype, see ir/types.py
except ImportError:  # a dependency of the package; refused with the install line when used
    pass

from backplan import nn, optim, random, tree
from backplan.artifacts.export import export
from backplan.artifacts.format import ExportError
from backplan.artifacts.load import load
from backplan.artifacts.safetensors_file import load_safetensors, save_safetensors
from backplan.artifacts.tree_file import TreeFileError, load_tree, save_tree
from backplan.codegen.build.cache_signing import CacheError, CacheWarning
from backplan.codegen.build.driver_tier import DriverBuildWarning
from backplan.ir.errors import (
    BackplanError,
    DtypeError,
    ExecutionError,
    MemoryBudgetError,
    ParseError,
    ShapeError,
    VerifyError,
)
from backplan.runtime import (
    BackwardError,
    GraphFreedError,
    enable_grad,
    is_grad_enabled,
    live_saved_bytes,
    no_grad,
)
from backplan.tracer import Tensor, TracingError, compile, grad, value_and_grad
from backplan.tracer.attention import scaled_dot_product_attention
from backplan.tracer.compile import RetraceWarning
from backplan.tracer.conv import arange, argmax, argmin, avg_pool2d, clip, conv2d, max_pool2d
from backplan.tracer.dlpack import from_dlpack
from backplan.tracer.errors import DonatedError
from backplan.tracer.explain import explain
from backplan.tracer.float64_promotion import Float64PromotionWarning
from backplan.tracer.graph_view import explain_graph
from backplan.tracer.max_batch import max_batch
from backplan.tracer.ops import *  # noqa: F403  (every op users call; tracer/ops.py lists them)
from backplan.tracer.ops import __all__ as _ops_all
from backplan.tracer.pytree import leaves as _tree_leaves
from backplan.tracer.pytree import tree_map
from backplan.tracer.random import dropout
from backplan.tracer.signature import tensor_attributes as _tensor_attributes

__version__ = "0.1.0"
_TORCH_NAMES = ("from_torch", "to_state_dict", "TorchImportError")


def __getattr__(name: str):
    """bp.from_torch and bp.to_state_dict import torch on first use, not with backplan; one
    function, since a second `def __getattr__` in this module would replace the first."""
    if name in _TORCH_NAMES:
        from backplan import torch as _torch_interop

        return getattr(_torch_interop, name)
    if name == "bfloat16":  # only reached when ml_dtypes is missing
        raise ImportError("bp.bfloat16 needs the ml_dtypes package: pip install ml_dtypes")
    from backplan.tracer.torch_names import MODULE_SPELLINGS, no_such_attribute

    raise no_such_attribute("module 'backplan'", name, MODULE_SPELLINGS)


def zero_grad(params: object) -> None:
    """Clear .grad of every tensor in a pytree (a model's parameters, say). An object of an
    unregistered class holding tensors is refused: its tensors would keep their gradients."""
    if type(params) is dict:  # a flat dict of tensors, every step of a loop: no tree walk
        for v in params.values():  # one loop, not all(generator) then another
            if type(v) is not Tensor:
                break  # the walk below clears the rest and refuses what it must
            v.grad = None
        else:
            return
    for leaf in _tree_leaves(params):
        if isinstance(leaf, Tensor):
            leaf.zero_grad()
        elif held := _tensor_attributes(leaf):
            raise TypeError(
                f"bp.zero_grad: a {type(leaf).__name__} object holds tensors (.{', .'.join(held)}) "
                "that a pytree walk cannot see; make the class a dataclass or register it with "
                "bp.tree.register"
            )


__all__ = [
    *_ops_all,
    "BackplanError",
    "BackwardError",
    "CacheError",
    "CacheWarning",
    "DonatedError",
    "DriverBuildWarning",
    "DtypeError",
    "ExecutionError",
    "ExportError",
    "Float64PromotionWarning",
    "GraphFreedError",
    "MemoryBudgetError",
    "ParseError",
    "RetraceWarning",
    "ShapeError",
    "Tensor",
    "TracingError",
    "TreeFileError",
    "VerifyError",
    "bool_",
    "bfloat16",
    "float16",
    "float32",
    "float64",
    "int32",
    "int64",
    "uint8",
    "arange",
    "argmax",
    "argmin",
    "avg_pool2d",
    "clip",
    "compile",
    "conv2d",
    "scaled_dot_product_attention",
    "dropout",
    "max_pool2d",
    "nn",
    "random",
    "enable_grad",
    "explain",
    "explain_graph",
    "export",
    "from_dlpack",
    "grad",
    "is_grad_enabled",
    "live_saved_bytes",
    "load",
    "load_tree",
    "load_safetensors",
    "max_batch",
    "no_grad",
    "tree",
    "optim",
    "save_tree",
    "save_safetensors",
    "tree_map",
    "value_and_grad",
    "zero_grad",
]
