"""PyTorch's keyword spellings on backplan's ops. Where the meaning is the same, `dim=` and
`keepdim=` are taken as `axis=` and `keepdims=` (x.sum(dim=1, keepdim=True) runs as written);
where PyTorch's op means something else under the same name (max(dim=) returns values and
indices, var(dim=) is unbiased), the call raises with the backplan spelling instead of
silently giving another answer."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from .source import loc_text, user_frame_loc

F = TypeVar("F", bound=Callable[..., Any])
_RENAMES = {"dim": "axis", "keepdim": "keepdims", "start_dim": "start_axis"}


def torch_keywords(fn: F) -> F:
    """Accept dim= for axis= and keepdim= for keepdims= (the meanings match)."""

    @functools.wraps(fn)
    def _torch_named(*args, **kwargs):
        if kwargs.keys() & _RENAMES.keys():
            kwargs = _renamed(fn.__name__, kwargs)
        return fn(*args, **kwargs)

    return _torch_named  # type: ignore[return-value]


def _renamed(name: str, kwargs: dict) -> dict:
    out = {}
    for key, value in kwargs.items():
        new = _RENAMES.get(key, key)
        if new in out or (new != key and new in kwargs):
            raise TypeError(
                f"{name}() at {loc_text(user_frame_loc())} got both {key}= and {new}=; "
                f"backplan spells it {new}="
            )
        out[new] = value
    return out


def refuse_torch_dim(why: Callable[[str, Any], str]) -> Callable[[F], F]:
    """Refuse dim= where PyTorch's op of this name means something else: `why(name, dim)`
    says what PyTorch returns and how to write it in backplan."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def _dim_refused(*args, **kwargs):
            if "dim" in kwargs:
                raise TypeError(
                    f"{fn.__name__}(dim={kwargs['dim']!r}) at {loc_text(user_frame_loc())}: "
                    f"{why(fn.__name__, kwargs['dim'])}"
                )
            if "keepdim" in kwargs:
                kwargs = _renamed(fn.__name__, kwargs)
            return fn(*args, **kwargs)

        return _dim_refused  # type: ignore[return-value]

    return wrap


def extremum_values_and_indices(name: str, dim: Any) -> str:
    arg = "argmax" if name == "max" else "argmin"
    return (
        f"in PyTorch this returns (values, indices); backplan's x.{name}(axis={dim}) returns "
        f"the values and bp.{arg}(x, axis={dim}) the indices"
    )


def variance_correction(name: str, dim: Any) -> str:
    return (
        "PyTorch's var(dim=) is the unbiased variance (correction=1); backplan's "
        f"x.var(axis={dim}) is the population variance (ddof=0), as np.var. For PyTorch's "
        f"value multiply by n / (n - 1), n = x.shape[{dim}]"
    )


_IMMUTABLE = (
    "tensors are immutable: build a new one (x + y, bp.zeros_like(x)); a training step returns "
    "new parameters (bp.optim)"
)
# PyTorch names backplan spells otherwise: the AttributeError says how (never a silent alias)
TENSOR_SPELLINGS = {
    "t": "x.T (x.swapaxes(a, b) for two axes of more)",
    "float": "x.astype(bp.float32)",
    "double": "x.astype(bp.float64)",
    "half": "x.astype(bp.float16)",
    "long": "x.astype(bp.int64)",
    "int": "x.astype(bp.int32)",
    "to": "x.astype(dtype); backplan tensors live in host memory, there is no device to move to",
    "cuda": "not available: backplan runs on the CPU",
    "cpu": "x itself: backplan tensors live in host memory",
    "numel": "x.size",
    "dim": "x.ndim",
    "clone": "x itself: tensors are immutable, so a copy is never needed",
    "clamp": "bp.clip(x, lo, hi)",
    "std": "bp.sqrt(x.var(axis=d)), the population deviation (ddof=0; PyTorch's is unbiased)",
    "expand": "bp.broadcast_to(x, shape)",
    "masked_fill": "bp.where(mask, value, x)",
    "requires_grad_": "bp.tensor(array, requires_grad=True)",
    **{name: _IMMUTABLE for name in ("zero_", "add_", "sub_", "mul_", "div_", "copy_", "fill_")},
}
MODULE_SPELLINGS = {
    "cat": "bp.concatenate(tensors, axis=0)",
    "clamp": "bp.clip(x, lo, hi)",
    "from_numpy": "bp.tensor(array) (bp.from_dlpack(array) shares its memory)",
    "randn": "bp.random.normal(key, shape) with key = bp.random.key(seed)",
    "rand": "bp.random.uniform(key, shape) with key = bp.random.key(seed)",
    "manual_seed": "key = bp.random.key(seed), passed to bp.random's functions",
}


def no_such_attribute(owner: str, name: str, spellings: dict) -> AttributeError:
    """AttributeError for `name`, saying backplan's spelling where it is a PyTorch name."""
    message = f"{owner} has no attribute {name!r}"
    if name in spellings:
        message += f" (PyTorch's {name}; in backplan: {spellings[name]})"
    return AttributeError(message)


def spelling_only(name: str) -> property:
    """A Tensor attribute for a PyTorch-only name: reading it raises the AttributeError that
    names backplan's spelling (an AttributeError, so hasattr() stays False). A property, not a
    __getattr__, so NumPy's probes of missing attributes stay as fast and mypy sees no name."""

    def refuse(self):
        raise no_such_attribute("'Tensor' object", name, TENSOR_SPELLINGS)

    return property(refuse)
