"""The signature cache key: pytree structure, shapes, dtypes, requires_grad flags, the layout
of each array (C order or why not: a compiled call copies any other, and the plans' peaks count
that copy, ir/argument_layout.py) and static values, each part named so a miss can say exactly
what changed."""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field, replace

import numpy as np

from backplan.ir.argument_layout import (
    BROADCAST,
    C_ORDER,
    REVERSED,
    SLICED,
    base,
    copied_inputs,
    layout,
    viewed,
)
from backplan.ir.errors import DtypeError
from backplan.ir.types import dtype_name
from backplan.runtime import is_grad_enabled
from backplan.runtime.execute import count_argument_copy

from .errors import TracingError
from .numpy_args import borrowed
from .operand_errors import how_to_pass, what_value_is
from .pytree import TreeDef, difference, flatten, unflatten
from .pytree import leaves as tree_leaves
from .source import loc_text, user_frame_loc
from .tensor import Tensor


@dataclass(frozen=True)
class LeafKey:
    path: str
    kind: str  # "tensor" or "static"
    shape: tuple | None = None
    dtype: str | None = None
    requires_grad: bool = False
    static: object = None
    weak: bool = False  # a Python float, traced as a weakly typed 0-d tensor
    layout: str = C_ORDER  # the array as passed (ir/argument_layout.py): "C", "F-order", ...
    # passed as a NumPy array, where that is part of the signature (numpy_apart: a memory
    # budget plans the copy of one its backward reads)
    numpy: bool = False

    def describe(self) -> str:
        if self.weak:
            return "traced float"
        if self.kind == "tensor":
            rg = ", requires_grad" if self.requires_grad else ""
            order = f", {self.layout}" if self.layout != C_ORDER else ""
            kind = "NumPy array" if self.numpy else "tensor"
            return f"{kind} {self.dtype}{list(self.shape)}{rg}{order}"
        return f"static {self.static[1]!r}"


@dataclass(frozen=True)
class SignatureKey:
    treedef: TreeDef
    leaves: tuple[LeafKey, ...]

    def __hash__(self) -> int:
        """Hashed once: the cache moves its entry to the end whenever calls switch signature."""
        found = self.__dict__.get("_hash")
        if found is None:
            found = hash((self.treedef, self.leaves))
            object.__setattr__(self, "_hash", found)
        return found

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}  # str hashes are salted


@dataclass
class BoundCall:
    """One call split into dynamic tensors and everything else."""

    key: SignatureKey
    leaves: list
    tensor_positions: list[int] = field(default_factory=list)
    signature: inspect.Signature | None = None
    sources: list = field(default_factory=list)  # each leaf as passed (floats before tracing)
    arguments: list = field(default_factory=list)  # the parameter name each leaf belongs to
    # leaf positions whose tensor is a read-only view of the caller's NumPy array, not a copy:
    # the call copies those that outlive it, as later calls do (tracer/numpy_args.py)
    borrowed: frozenset = frozenset()

    def call(self, fn, leaves):
        """Call fn with these leaves put back into the original argument structure."""
        arguments = unflatten(self.key.treedef, leaves)
        bound = inspect.BoundArguments(self.signature, arguments)
        return fn(*bound.args, **bound.kwargs)


def bind_call(fn, args: tuple, kwargs: dict, static: frozenset = frozenset()) -> BoundCall:
    """Split a call into its leaves. Tensors, arrays and Python floats are dynamic (floats as
    weakly typed 0-d tensors, so a new learning rate does not retrace); everything else, and
    every leaf of a parameter named in `static`, is part of the signature by value. A default
    the caller did not pass is a constant of the function, as in jax.jit: static by value."""
    try:
        signature = inspect.signature(fn)
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"{fn.__qualname__}(): {exc}") from None
    passed = set(bound.arguments)
    bound.apply_defaults()
    leaves, treedef, paths = flatten(dict(bound.arguments), paths=True)
    sources = list(leaves)
    keys, positions, arguments, views = [], [], [], set()
    for i, (leaf, path) in enumerate(zip(leaves, paths, strict=True)):
        path = _argument_path(path)
        argument = re.match(r"\w*", path).group(0)
        arguments.append(argument)
        order = layout(leaf) if isinstance(leaf, np.ndarray) else C_ORDER
        if isinstance(leaf, np.ndarray):  # read in place on later calls: its own layout counts
            leaves[i] = leaf = _argument_tensor(fn, path, leaf, order)
            if sources[i].dtype.isnative:  # a view of the caller's memory: no copy made
                views.add(i)
        if type(leaf) is float and argument not in static and argument in passed:
            leaves[i] = Tensor._weak_scalar(leaf)
            positions.append(i)
            keys.append(LeafKey(path, "tensor", (), "f64", weak=True))
        elif isinstance(leaf, Tensor):
            leaf._check_live()
            positions.append(i)
            rg = bool(leaf.requires_grad and is_grad_enabled())
            if order == C_ORDER and leaf._data is not None:
                order = layout(leaf._data)
            key = LeafKey(path, "tensor", leaf.shape, leaf._ir_dtype, rg, weak=leaf._weak)
            keys.append(key if order == C_ORDER else replace(key, layout=order))
        else:
            keys.append(LeafKey(path, "static", static=_static_key(leaf, path)))
    key = SignatureKey(treedef, tuple(keys))
    return BoundCall(key, leaves, positions, signature, sources, arguments, frozenset(views))


def numpy_apart(call: BoundCall) -> BoundCall:
    """call with its NumPy arguments told apart from tensors in the signature: a budgeted
    function (max_peak_bytes, saved_bytes_budget) plans each kind on its own, so the plan a
    call runs counts the copy it takes of a NumPy array its backward reads (a plan chosen for
    tensors would leave that copy out of the budget). One trace per kind passed."""
    leaves = list(call.key.leaves)
    found = False
    for p in call.tensor_positions:
        if isinstance(call.sources[p], np.ndarray):
            leaves[p] = replace(leaves[p], numpy=True)
            found = True
    if not found:
        return call
    return replace(call, key=SignatureKey(call.key.treedef, tuple(leaves)))


def copied_leaves(call: BoundCall) -> tuple[tuple[int, str], ...]:
    """(graph input, layout) of each tensor argument passed in another layout than C order:
    what PipelineOptions.copied takes (a plan's inputs are the tensor leaves, in order)."""
    layouts = [call.key.leaves[p].layout for p in call.tensor_positions]
    return copied_inputs(layouts)


def _argument_tensor(fn, path: str, array: np.ndarray, order: str = C_ORDER) -> Tensor:
    """A NumPy argument as a tensor: a read-only view of the caller's array, no copy, in the
    array's own layout, as later calls pass it (the plan reads it in place,
    ir/in_place_inputs.py; the call copies it only where it outlives the call:
    tracer/numpy_args.py). An array in another byte order is converted (a copy, its values in
    this machine's order); a dtype backplan refuses names the function, the argument and the
    caller's line, as an op's error does."""
    try:
        if array.dtype.isnative:
            dtype_name(array.dtype)  # refuses complex, object, ... as Tensor(array) does
            return Tensor._from_array(borrowed(array))
        if order.startswith((BROADCAST, REVERSED, SLICED)):
            compact = Tensor(base(array, order))  # checked and copied, in C order
            count_argument_copy(compact._data)
            return Tensor._from_array(viewed(compact._data, order, array.shape))
        converted = Tensor(array)
        count_argument_copy(converted._data)  # explain counts it (numpy_args.call_copies)
        return converted
    except DtypeError as exc:
        loc = user_frame_loc()
        where = f" at {loc_text(loc)}" if loc is not None else ""
        raise DtypeError(f"{fn.__qualname__}(): argument {path}: {exc}{where}") from None


def _argument_path(path: str) -> str:
    """ "['params']['w0']" -> "params['w0']": the argument name, then the path inside it."""
    match = re.match(r"\['(\w+)'\]", path)
    return match.group(1) + path[match.end() :] if match else path


def _static_key(value, path):
    held = tensor_attributes(value)
    if held:
        raise TracingError(
            f"argument {path} is a {type(value).__name__} object holding tensors "
            f"(.{', .'.join(held)}); as an object of an unregistered class it would be one "
            "static value, so the plan would keep the tensors it saw first and never see them "
            "change. Make the class a dataclass, register it with bp.tree.register, or pass its "
            "tensors (a dict) instead"
        )
    if hasattr(value, "__dlpack__"):  # a torch tensor is hashable: it would be static
        raise TracingError(
            f"argument {path} is {what_value_is(value)}: a compiled function takes backplan "
            "tensors and NumPy arrays as inputs, and would keep any other object as one static "
            f"value, its values frozen into the plan; {how_to_pass(value)}"
            + (f" (the call at {loc_text(loc)})" if (loc := user_frame_loc()) else "")
        )
    try:
        hash(value)
    except TypeError:
        raise TracingError(
            f"argument {path} of type {type(value).__name__} is neither a tensor nor hashable; "
            "static arguments must be hashable (ints, floats, strings, tuples)"
        ) from None
    return (type(value).__name__, value)


def tensor_attributes(value) -> list[str]:
    """Attributes of an ordinary object whose pytrees hold tensors or arrays."""
    if isinstance(value, type) or inspect.ismodule(value) or not hasattr(value, "__dict__"):
        return []
    return [
        name
        for name, attribute in vars(value).items()
        if any(isinstance(leaf, Tensor | np.ndarray) for leaf in tree_leaves(attribute))
    ]


def closest_key(cached, new: SignatureKey, last: SignatureKey | None) -> SignatureKey | None:
    """The cached signature a miss is explained against: of those with the same structure, the
    one with the fewest leaves changed (JAX explains against the closest entry too; `cached` is
    in least-recently-used order, so ties go to the most recent); the last call's signature
    when none has the same structure."""
    best, fewest = last, None
    for old in cached:
        if old.treedef != new.treedef:
            continue
        changed = sum(a != b for a, b in zip(old.leaves, new.leaves, strict=True))
        if fewest is None or changed <= fewest:  # ties: the most recently used
            best, fewest = old, changed
    return best


def miss_reason(old: SignatureKey | None, new: SignatureKey) -> str:
    if old is None:
        return "first call"
    if old.treedef != new.treedef:
        where = difference(old.treedef, new.treedef)
        return f"the structure of the arguments changed (pytree shape or keyword set) at {where}"
    changes = []
    for a, b in zip(old.leaves, new.leaves, strict=True):
        if a == b:
            continue
        if a.kind != b.kind:
            changes.append(f"{b.path}: {a.describe()} -> {b.describe()}")
        elif a.kind == "static":
            changes.append(f"{b.path}: static value {a.static[1]!r} -> {b.static[1]!r}")
        else:
            for part in ("shape", "dtype", "requires_grad", "weak", "layout"):
                if getattr(a, part) != getattr(b, part):
                    changes.append(f"{b.path}: {part} {getattr(a, part)} -> {getattr(b, part)}")
            if a.numpy != b.numpy:
                kinds = ("a tensor", "a NumPy array")
                changes.append(
                    f"{b.path}: {kinds[a.numpy]} -> {kinds[b.numpy]} (under a memory budget "
                    "each kind is planned apart: a NumPy array the backward reads is copied at "
                    "the call, and the budget counts that copy)"
                )
    text = "; ".join(changes) or "captured tensors changed"
    if not is_grad_enabled() and any(a.requires_grad for a in old.leaves if a.kind == "tensor"):
        text += f" ({NO_GRAD_NOTE})"
    return text


NO_GRAD_NOTE = (
    "bp.no_grad() is on: a forward-only plan that builds no graph, traced once and kept beside "
    "the training plan, so the next call under no_grad reuses it"
)
