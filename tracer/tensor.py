"""Tensor: a value that is either concrete (a read-only NumPy array) or a tracer in a graph."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from backplan.ir.errors import DtypeError, ShapeError
from backplan.ir.lowering import BackwardMode
from backplan.ir.types import dtype_name, is_float, np_dtype
from backplan.runtime import BackwardError, Edge
from backplan.runtime import engine as _engine

from .errors import DonatedError, TracingError
from .source import loc_text, user_frame_loc
from .tensor_methods import TensorMethods
from .traced_size import TracedSize, active_log, from_user


def read_only(array: np.ndarray) -> None:
    """array.flags.writeable = False, at a third of the cost (no flags object is made): every
    compiled call freezes each output and each borrowed NumPy argument."""
    _setflags(array, False)  # type: ignore[call-arg]  # positional: cheapest


_setflags = np.ndarray.setflags
_ONES: dict = {}  # (shape, dtype) -> a ones array to copy: np.ones costs ~5x a copy


def _ones_like(data: np.ndarray) -> np.ndarray:
    """A new array of ones of data's shape and dtype (backward()'s default gradient)."""
    key = (data.shape, data.dtype)
    ones = _ONES.get(key)
    if ones is None:
        if len(_ONES) > 64:
            _ONES.clear()
        ones = _ONES[key] = np.ones(data.shape, data.dtype)
        read_only(ones)
    copy = ones.copy()  # a new, writeable array the backward plan may use as scratch
    return copy


def to_array(data, dtype=None) -> np.ndarray:
    """A fresh array for a new tensor. NumPy arrays and tensors keep their dtype; Python floats
    make float32 (as PyTorch and JAX), Python ints int64. A dtype outside the supported set
    raises DtypeError; nothing is converted behind the caller's back, but for the byte order:
    a big-endian float32 (read from a FITS, .mat or network file) holds float32 values, stored
    in this machine's order as NumPy's own arithmetic would."""
    if dtype is not None:
        target = np_dtype(dtype_name(dtype))
        source = _source_dtype(data)
        if source is not None:
            dtype_name(native_order(source))  # refuse complex, object, ... even when cast
        return np.array(data, dtype=target)
    if isinstance(data, Tensor):
        return np.array(data.numpy())
    if isinstance(data, np.ndarray | np.generic):
        native = native_order(data.dtype)
        dtype_name(native)
        return np.array(data, dtype=native)
    array = _from_nested(data)
    array = array.astype(native_order(array.dtype), copy=False)
    if array.dtype == np.float64:
        array = array.astype(np.float32)  # Python floats make float32, as torch and JAX
    elif array.dtype == np.uint64:  # not int32 or uint8: a list of NumPy values keeps theirs
        array = _python_ints(array)
    dtype_name(array.dtype)
    return array


def native_order(dtype: np.dtype) -> np.dtype:
    """dtype in this machine's byte order: the same values, the only order kernels read."""
    return dtype if dtype.isnative else dtype.newbyteorder("=")


def _from_nested(data) -> np.ndarray:
    """np.array(data), whose ValueError for ragged nested lists names no op and no shape."""
    try:
        return np.array(data)
    except ValueError as exc:
        if not isinstance(data, list | tuple):
            raise
        lengths = [len(row) if isinstance(row, list | tuple) else "a number" for row in data]
        raise ShapeError(
            f"tensor: nested lists of different lengths cannot make one tensor (its rows hold "
            f"{', '.join(map(str, lengths[:8]))}{', ...' if len(lengths) > 8 else ''}); pad "
            "them to one length, or keep one tensor per row"
        ) from exc


def _source_dtype(data):
    if isinstance(data, Tensor):
        return None
    if isinstance(data, np.ndarray | np.generic):
        return data.dtype
    return _from_nested(data).dtype


def _python_ints(array: np.ndarray) -> np.ndarray:
    """Python ints beyond int64 make NumPy choose uint64 or object: refuse rather than wrap."""
    raise DtypeError(
        f"Python integers out of the int64 range ({array.dtype}) cannot be stored exactly; "
        "pass them as floats or reduce them first"
    )


class Tensor(TensorMethods):
    """Immutable n-dimensional array with autograd. Outside @compile ops run at once; inside,
    the same calls record a graph.

    >>> import backplan as bp
    >>> x = bp.tensor([1.0, 2.0], requires_grad=True)
    >>> y = (x * x).sum()
    >>> y.backward()
    >>> x.grad.numpy().tolist()
    [2.0, 4.0]
    """

    __slots__ = (
        "_data",
        "_value",
        "_trace",
        "_requires_grad",
        "grad",
        "_grad_fn",
        "_out_index",
        "_scalar",
        "_weak",
        "_donated",
        "__weakref__",
    )
    __array_priority__ = 1000  # ndarray + Tensor defers to Tensor.__radd__

    def __init__(self, data, dtype=None, requires_grad: bool = False):
        self._init(to_array(data, dtype), None, None)
        self.requires_grad = requires_grad

    def _init(self, data, value, trace, grad_fn=None, out_index=0):
        self._data = data
        self._out_index = out_index
        self._scalar = None  # the Python value, for 0-d constants made from Python scalars
        self._weak = False  # a traced Python float: promotes like a Python scalar
        self._donated = None  # where it was donated to a compiled call; then unusable
        self._value = value
        self._trace = trace
        self._grad_fn = grad_fn
        self._requires_grad = grad_fn is not None
        self.grad = None
        if data is not None:
            read_only(data)

    @classmethod
    def _from_array(cls, array: np.ndarray, grad_fn=None, out_index: int = 0) -> Tensor:
        if type(array) is not np.ndarray:
            array = np.asarray(array)
        if array.base is not None and array.flags.writeable:
            array = array.copy()  # never freeze someone else's buffer (a view of it)
        tensor = cls.__new__(cls)  # _init's fields, set here: every recorded output comes here
        tensor._data = array
        tensor._value = tensor._trace = tensor.grad = tensor._scalar = tensor._donated = None
        tensor._grad_fn = grad_fn
        tensor._requires_grad = grad_fn is not None
        tensor._out_index = out_index
        tensor._weak = False
        _setflags(array, False)  # read_only(array), inline
        return tensor

    @classmethod
    def _fresh(cls, array: np.ndarray) -> Tensor:
        """Wrap an array nobody else holds (a compiled plan's output): the cheapest path."""
        tensor = cls.__new__(cls)
        tensor._data = array
        tensor._value = tensor._trace = tensor._grad_fn = tensor.grad = tensor._scalar = None
        tensor._donated = None
        tensor._out_index = 0
        tensor._requires_grad = tensor._weak = False
        _setflags(array, False)  # read_only(array), inline: every .grad and output comes here
        return tensor

    @classmethod
    def _traced(cls, value, trace, requires_grad: bool = False, weak: bool = False) -> Tensor:
        tensor = cls.__new__(cls)
        tensor._init(None, value, trace)
        tensor._requires_grad = requires_grad
        tensor._weak = weak
        return tensor

    @classmethod
    def _weak_scalar(cls, value: float) -> Tensor:
        """A Python float argument of a compiled function: a 0-d float64 input that promotes
        like the Python float it came from (weakly typed, as in JAX)."""
        tensor = cls._fresh(np.array(value, np.float64))
        tensor._weak = True
        return tensor

    def _check_live(self) -> None:
        """Raise if this tensor's buffer was donated to a compiled call."""
        if self._donated is not None:
            raise DonatedError(
                f"this tensor ({self._ir_dtype}{list(self.shape)}) was donated to {self._donated}: "
                "its buffer now holds one of that call's results. Use the value the call "
                "returned (params, state = step(params, state, ...)), or leave the argument "
                "out of donate_argnums to keep the input usable."
            )

    # ---- metadata ------------------------------------------------------------------------------

    @property
    def _ir_dtype(self) -> str:
        return self._value.dtype if self._data is None else dtype_name(self._data.dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        if self._data is None:
            return self._traced_shape(2)
        return self._data.shape

    def _traced_shape(self, depth: int) -> tuple[int, ...]:
        """A tracer's shape; while a dynamic axis is traced, the user's code (`depth` frames
        up) reads sizes that record what it does with them (tracer/traced_size.py)."""
        log = active_log()
        if log is not None and from_user(depth):
            return log.shape(self._value.shape)
        return self._value.shape

    @property
    def dtype(self) -> np.dtype:
        return np_dtype(self._ir_dtype)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> Size:
        """The number of elements, as NumPy's `a.size`; also callable as PyTorch's `x.size()`
        (the shape) and `x.size(dim)` (one dimension)."""
        shape = self._data.shape if self._data is not None else self._traced_shape(2)
        return Size(math.prod(shape), shape)  # not np.prod: ~20x the cost on a small tuple

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __len__(self) -> int:
        shape = self._data.shape if self._data is not None else self._traced_shape(2)
        if not shape:
            raise TypeError("len() of a 0-d tensor")
        if isinstance(shape[0], TracedSize):  # len() makes it a plain int: followed no further
            shape[0]._log.lost.append(user_frame_loc())
        return shape[0]

    # ---- autograd ------------------------------------------------------------------------------

    @property
    def requires_grad(self) -> bool:
        return self._requires_grad

    @requires_grad.setter
    def requires_grad(self, flag: bool) -> None:
        if self._grad_fn is not None and not flag:
            raise BackwardError("requires_grad can only be cleared on a leaf; use .detach()")
        if flag and not is_float(self._ir_dtype):
            raise BackwardError(f"only float tensors can require grad, this one is {self.dtype}")
        self._requires_grad = bool(flag)

    @property
    def grad_fn(self):
        """The region that made this tensor: its backward plan and saved buffers (None for
        leaves). `print(t.grad_fn)` shows each saved buffer and whether it has been freed."""
        return self._grad_fn

    @property
    def is_leaf(self) -> bool:
        return self._grad_fn is None

    def _edge(self) -> Edge:
        if self._grad_fn is not None:
            return Edge(region=self._grad_fn, index=self._out_index)
        return Edge(leaf=self)

    def _accumulate_grad(self, array: np.ndarray) -> None:
        """A first gradient is kept as it comes (a plan's fresh output; _from_array copies a
        view of someone else's buffer): reshaping it regardless made every .grad a copy."""
        data = self._data  # a leaf is concrete: its dtype without the dtype-name lookups
        if self.grad is None and type(array) is np.ndarray and data is not None:
            if array.dtype == data.dtype and array.shape == data.shape:  # a plan's output
                fresh = array.base is None  # nobody else's buffer: wrapped as it is
                self.grad = Tensor._fresh(array) if fresh else Tensor._from_array(array)
                return
        if data is None:
            array = np.asarray(array, dtype=self.dtype)
        elif type(array) is not np.ndarray or array.dtype != data.dtype:
            array = np.asarray(array, dtype=data.dtype)
        shape = self.shape
        if array.shape != shape:
            array = array.reshape(shape)
        self.grad = Tensor._from_array(array if self.grad is None else self.grad._data + array)

    def _add_plan_grad(self, array: np.ndarray) -> None:
        """A gradient a plan computed for this leaf: its dtype and shape by construction, so a
        first one is wrapped with no checks (a view of a buffer is copied, as _from_array)."""
        if self.grad is None and self._data is not None:
            # a view the plan froze (its reshaped outputs) is nobody's to write: no copy
            if array.base is None or not array.flags.writeable:
                self.grad = _fresh(array)
            else:
                self.grad = Tensor._from_array(array)
            return
        self._accumulate_grad(array)

    @staticmethod
    def _add_plan_grads(leaves: list, arrays: list) -> None:
        """_add_plan_grad for each leaf (a compiled step's parameters, once a step): a first
        gradient in the plan's own array, the common case, wrapped here without a call each."""
        for leaf, array in zip(leaves, arrays, strict=True):
            if leaf.grad is None and leaf._data is not None:
                if array.base is None or not array.flags.writeable:
                    leaf.grad = _fresh(array)
                    continue
            leaf._add_plan_grad(array)

    @staticmethod
    def _add_joint_grads(leaves: list, arrays: list) -> None:
        """_add_plan_grads for the gradients a joint step's plan computed with its forward
        (runtime/joint_step.py): each array is the plan's own, or its frozen view, or a view
        of a read-only input (no input of a joint step is donated), so a first gradient is
        wrapped as it is, with no view or flags test (as value_and_grad wraps the same
        plan's outputs)."""
        for leaf, array in zip(leaves, arrays, strict=True):
            if leaf.grad is None:
                leaf.grad = _fresh(array)
            else:
                leaf._accumulate_grad(array)

    def backward(self, gradient=None, retain_graph: bool = False, create_graph: bool = False):
        """Run the backward plans from this tensor and add gradients into leaf .grad.
        Without retain_graph, every region reached frees its saved buffers as it goes."""
        grad_fn = self._grad_fn
        # kept as it is: its text is made when a message needs it. This frame is backward
        # itself: passed over in one step, named as the walk would have named it
        where = user_frame_loc(1, "backward")
        if (
            gradient is None
            and grad_fn is not None  # a concrete result of a recorded call (traced: no grad_fn)
            and grad_fn.ready
            and not retain_graph
            and not create_graph
            and self._donated is None
            and grad_fn.hand_over(where, self._out_index)
        ):
            return  # the forward ran one joint plan: its gradients went to the leaves
        self._check_live()
        if self._data is None:
            raise TracingError(
                f"backward() inside a traced function at {loc_text(where)}; use bp.grad"
            )
        if create_graph:
            raise BackwardError(
                f"backward(create_graph=True) at {loc_text(where)} is not supported; for higher "
                "derivatives use bp.grad(bp.grad(f)), whose backward is itself a differentiable "
                "plan"
            )
        if not self._requires_grad:
            raise BackwardError(
                f"backward() at {loc_text(where)} on a tensor that does not require grad"
            )
        gradient = self._seed_gradient(gradient, where)
        if self._grad_fn is None:
            self._accumulate_grad(gradient)
            return
        _engine.backward(
            self._grad_fn, self._out_index, gradient, BackwardMode.of(retain_graph), where
        )

    def _seed_gradient(self, gradient, where) -> np.ndarray:
        """The gradient backward() starts from, as a new array the plan may overwrite (a
        consuming backward reuses its inputs' memory): ones for a one-element tensor."""
        data = self._data
        if gradient is None:
            if data.size != 1:  # one element of any shape, (1,) included, as PyTorch
                raise BackwardError(
                    f"backward() at {loc_text(where)} on a non-scalar tensor of shape "
                    f"{self.shape} needs a gradient argument of that shape (or reduce it to a "
                    "scalar with .sum())"
                )
            return _ones_like(data)
        gradient = np.array(
            gradient.numpy() if isinstance(gradient, Tensor) else gradient, dtype=data.dtype
        )
        if gradient.shape != data.shape:
            raise BackwardError(
                f"backward() at {loc_text(where)}: gradient has shape {gradient.shape}, tensor "
                f"has {data.shape}"
            )
        return gradient

    def zero_grad(self) -> None:
        self.grad = None

    # ---- conversion ----------------------------------------------------------------------------

    def _float_argument(self) -> str | None:
        """The compiled function's argument this traced Python float came from, if it did."""
        return self._trace.floats.get(self._value) if self._trace is not None else None

    def _concrete(self, what: str) -> np.ndarray:
        if self._donated is not None:
            self._check_live()
        if self._data is None:
            if self._weak:
                argument = self._float_argument()
                raise TracingError(
                    f"{what} of a traced float{f' (argument {argument})' if argument else ''} "
                    f"at {loc_text(user_frame_loc())}: Python floats "
                    "passed to a compiled function are traced (so a new value does not "
                    "retrace), so their value is not known while tracing. Where the value "
                    "must be a Python number (a shape, a flag, an op attribute), mark the "
                    f"argument static: bp.compile(fn, static_argnames=('{argument or 'name'}',))."
                )
            raise TracingError(
                f"{what} of a traced tensor at {loc_text(user_frame_loc())}: inside @compile the "
                "value is not known yet, so Python control flow cannot depend on it. Use "
                "bp.where(cond, a, b) to choose between values, or move the decision out of the "
                "compiled function."
            )
        return self._data

    def numpy(self) -> np.ndarray:
        """The values as a NumPy array that shares the tensor's memory (no copy) and is
        read-only: writing into it raises `ValueError: assignment destination is read-only`,
        because saved buffers must never change behind the graph's back. Copy it
        (`t.numpy().copy()`) to get an array to change. The result is outside the graph: no
        gradient flows back through it."""
        return self._concrete("numpy()")

    def __array__(self, dtype=None, copy=None):
        """np.asarray(t): the values, read-only (see numpy()), outside the graph. Asking for an
        array is explicit, so it works on tensors that require grad (for plotting, say);
        NumPy *functions* on tensors keep the graph instead (numpy_protocol.py)."""
        array = self._concrete("np.asarray()")
        if dtype is not None:
            return array.astype(dtype)
        return array.copy() if copy else array

    def item(self) -> int | float | bool:
        """The single value of a one-element tensor as a Python number."""
        data = self._concrete("item()")
        if data.size != 1:
            raise ShapeError(
                f"item() at {loc_text(user_frame_loc())} on a tensor of shape {self.shape} with "
                f"{data.size} elements; item() needs exactly one (index first, t[i].item(), or "
                "use t.tolist())"
            )
        return data.item()

    def tolist(self):
        return self._concrete("tolist()").tolist()

    def __bool__(self) -> bool:
        return bool(self._concrete("bool()"))

    def __float__(self) -> float:
        return float(self._concrete("float()"))

    def __int__(self) -> int:
        return int(self._concrete("int()"))

    def __index__(self) -> int:
        return self._concrete("index()").__index__()

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __repr__(self) -> str:
        if self._donated is not None:
            return f"Tensor(<donated {self._ir_dtype}{list(self.shape)} to {self._donated}>)"
        if self._data is None:
            return f"Tensor(<traced {self._value.type}>)"
        body = np.array2string(self._data, separator=", ", prefix="tensor(")
        extra = f", dtype={self.dtype}" if self.dtype != np.float32 else ""
        if self._grad_fn is not None:
            extra += f", grad_fn=<{self._grad_fn.name}>"
        elif self.requires_grad:
            extra += ", requires_grad=True"
        return f"tensor({body}{extra})"

    __hash__ = object.__hash__

    def __setitem__(self, key, value):
        raise TypeError(
            "backplan tensors are immutable (saved buffers can never be changed behind the "
            "graph's back); build a new tensor with bp.where or bp.concatenate"
        )


class Size(int):
    """Tensor.size: an int (the element count, as NumPy) that PyTorch code can also call:
    `x.size()` is the shape tuple, `x.size(d)` the length of dimension d."""

    def __new__(cls, count: int, shape: tuple[int, ...]) -> Size:
        size = super().__new__(cls, count)
        size._shape = shape
        return size

    def __call__(self, dim: int | None = None) -> tuple[int, ...] | int:
        if dim is None:
            return self._shape
        ndim = len(self._shape)
        if not isinstance(dim, int | np.integer) or not -ndim <= dim < ndim:
            raise IndexError(
                f"size({dim!r}) at {loc_text(user_frame_loc())}: dimension out of range for a "
                f"tensor of shape {self._shape} (x.shape[d] is backplan's spelling)"
            )
        return self._shape[dim]


TensorLike = Tensor | np.ndarray | np.generic | float | int | bool | Sequence[Any]
DTypeLike = str | np.dtype | type
Axis = int | Sequence[int] | None


_fresh = Tensor._fresh  # bound once: .grad of every parameter of every step comes here
