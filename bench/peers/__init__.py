"""The peers: backplan (two paths), hand-written NumPy, PyTorch eager and compiled, JAX.
Optional frameworks are imported only when their peer builds a model."""

from __future__ import annotations

from ..errors import BenchError
from .backplan_peer import (
    BackplanBackgroundPeer,
    BackplanCompilePeer,
    BackplanPeer,
    BackplanReferencePeer,
)
from .base import Peer, Runner, SavedBytes, StepOutput
from .imported_peer import ImportedTorchPeer
from .jax_peer import JaxPeer
from .numpy_peer import NumpyPeer, reference_output
from .torch_peer import TorchCompilePeer, TorchPeer

PEERS: dict[str, type[Peer]] = {
    cls.name: cls
    for cls in (
        BackplanPeer,
        BackplanCompilePeer,
        BackplanBackgroundPeer,
        BackplanReferencePeer,
        ImportedTorchPeer,
        NumpyPeer,
        TorchPeer,
        TorchCompilePeer,
        JaxPeer,
    )
}
# What --against accepts: a family name selects all its peers. backplan.reference (backplan
# on its NumPy reference interpreter) and backplan.background (first calls on it while the
# plans compile out of process: a `bench compile` cell) are opt-in. backplan.from_torch (the
# torch peer's model imported with bp.from_torch) comes with any torch peer, except under
# --quick (torch.export is most of its first call: 67 s of a 248 s quick run) unless named.
AGAINST_CHOICES = {
    "backplan.from_torch": ["backplan.from_torch"],
    "backplan.reference": ["backplan.reference"],
    "backplan.background": ["backplan.background"],
    "numpy": ["numpy"],
    "torch": ["torch", "torch.compile"],
    "torch.eager": ["torch"],
    "torch.compile": ["torch.compile"],
    "jax": ["jax"],
}

IMPORTED = ImportedTorchPeer.name


def select_peers(against: list[str], imported_with_torch: bool = True) -> list[Peer]:
    """backplan's rows first, then the other peers named by --against (families expanded);
    the imported model's row beside any torch peer when `imported_with_torch`."""
    unknown = [name for name in against if name not in AGAINST_CHOICES]
    if unknown:
        raise BenchError(
            f"unknown peer(s) {', '.join(unknown)} in --against; choose from "
            f"{', '.join(AGAINST_CHOICES)} (or 'none')"
        )
    names = ["backplan", "backplan.compile"]
    for family in sorted(against, key=lambda name: not name.startswith("backplan")):
        names += [n for n in AGAINST_CHOICES[family] if n not in names]
    with_torch = any(n in names for n in AGAINST_CHOICES["torch"])
    if imported_with_torch and IMPORTED not in names and with_torch:
        backplan_rows = sum(n.startswith("backplan") for n in names)
        names.insert(backplan_rows, IMPORTED)  # the imported model, before the torch rows
    return [PEERS[n]() for n in names]


__all__ = [
    "PEERS",
    "AGAINST_CHOICES",
    "Peer",
    "Runner",
    "SavedBytes",
    "StepOutput",
    "reference_output",
    "select_peers",
]
