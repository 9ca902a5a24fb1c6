"""PyTorch interop (the `[torch]` extra): `from backplan.torch import from_torch`, or
`bp.from_torch` / `bp.to_state_dict`, which import torch only when first used.

>>> import backplan as bp  # doctest: +SKIP
>>> fn, params = bp.from_torch(model, (x,))  # doctest: +SKIP
"""

try:
    import torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "backplan.torch needs PyTorch: pip install 'backplan[torch]' (or pip install torch)"
    ) from exc

from backplan.interop.torch import TorchImportError, from_torch, to_state_dict

__all__ = ["TorchImportError", "from_torch", "to_state_dict"]
