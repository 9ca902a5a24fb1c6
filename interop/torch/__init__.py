"""Import a torch.nn.Module as a plain backplan function and hand its weights back (the
`[torch]` extra): from_torch exports the module with torch.export, decomposed to core ATen,
and maps each ATen op onto backplan's ops."""

from .errors import TorchImportError
from .importer import from_torch
from .state import to_state_dict

__all__ = ["TorchImportError", "from_torch", "to_state_dict"]
