"""The one error a PyTorch import raises: what torch could not capture, or what backplan cannot
map, with the user's module path and source line."""

from backplan.ir.errors import BackplanError


class TorchImportError(BackplanError, ValueError):
    """A module cannot be imported (torch.export refused it, an op has no mapping, a buffer is
    mutated in a way backplan cannot express) or called with the wrong inputs."""
