"""The error for an operand that is not a tensor, an array or a number: it says what the value
is (a torch.Tensor is also called Tensor, so the bare class name misleads) and how to pass it."""

from __future__ import annotations


class OperandTypeError(TypeError):
    """An op was given a value it cannot read as a tensor. Named in tracer/source._LOCATED, so
    the op the user called and the user's line are added to the message."""


def operand_type_error(value) -> OperandTypeError:
    return OperandTypeError(
        f"expected a backplan tensor or a NumPy array, got {what_value_is(value)}; "
        + how_to_pass(value)
    )


def what_value_is(value) -> str:
    """'a torch.Tensor of shape (2, 3) and dtype torch.float32', 'None', "a str ('x')"."""
    kind = type(value)
    package = kind.__module__.split(".")[0]
    name = kind.__qualname__ if package == "builtins" else f"{package}.{kind.__qualname__}"
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        return f"a {name} of shape {tuple(shape)} and dtype {dtype}"
    return "None" if value is None else f"a {name} ({_short(value)})"


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def how_to_pass(value) -> str:
    if hasattr(value, "__dlpack__"):
        return (
            "bp.from_dlpack(x) shares its memory (x.detach() first if it requires grad) and "
            "bp.tensor(x) copies it; a gradient does not flow back into the other framework"
        )
    if value is None:
        return "an argument or a value computed earlier is missing"
    if isinstance(value, int | float | complex) and not isinstance(value, bool):
        return f"this op takes a tensor, not a Python number: bp.tensor({value!r}) makes one"
    return "convert it with bp.tensor(...) (numbers, nested lists and NumPy arrays convert)"
