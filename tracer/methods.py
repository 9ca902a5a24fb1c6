"""What Tensor's methods call: tracer/tensor_methods.py declares them, and this module, which
can import the op functions (they import Tensor), binds those to them; tracer/__init__.py runs
it once, before any tensor exists."""

from collections.abc import Sequence

from . import conv, dlpack, indexing, inplace, numpy_protocol, ops, tensor_methods
from .graph_view import explain_graph
from .source import loc_text, user_frame_loc
from .tensor import Tensor
from .torch_names import TENSOR_SPELLINGS, spelling_only


def _detach(self: Tensor) -> Tensor:
    """Same values, cut from the graph: no gradient flows back through the result."""
    self._check_live()
    if self._data is None:
        return ops.stop_gradient(self)
    return Tensor._from_array(self._data)


def _view(self: Tensor, *shape) -> Tensor:
    """PyTorch's x.view(*shape): a reshape (tensors are immutable, so a view and a copy cannot
    be told apart). x.view(dtype) reinterprets bits in PyTorch, which backplan does not do."""
    if (
        len(shape) == 1
        and not isinstance(shape[0], int | Sequence)
        and not hasattr(shape[0], "__index__")
    ):
        raise TypeError(
            f"view({shape[0]!r}) at {loc_text(user_frame_loc())}: reinterpreting the bits as "
            "another dtype is not supported; x.astype(dtype) converts the values"
        )
    return ops.reshape(self, *shape)


def install_tensor_methods() -> None:
    """Bind the op functions Tensor's methods call (tracer/tensor_methods.py, where each is
    declared), then the protocols installed as a whole: NumPy's, the in-place operators that
    refuse, and the PyTorch spellings that say backplan's."""
    tensor_methods.bind(
        ops,
        getitem=indexing.getitem,
        graph=explain_graph,
        detach=_detach,
        view=_view,
        dlpack=dlpack.tensor_dlpack,
        dlpack_device=dlpack.tensor_dlpack_device,
        argmax=conv.argmax,
        argmin=conv.argmin,
    )
    numpy_protocol.install(Tensor)
    inplace.install(Tensor)
    defined = {name for cls in Tensor.__mro__ for name in vars(cls)}
    for name in TENSOR_SPELLINGS.keys() - defined:
        setattr(Tensor, name, spelling_only(name))
