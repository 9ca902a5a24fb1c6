"""In-place operators (`p -= lr * g`) raise: backplan tensors are immutable, so Python would
otherwise rebind the name (a silent no-op on the parameter) or turn a dict's parameter into a
non-leaf that fails one step later. The message shows the functional idiom instead."""

from __future__ import annotations

from .source import loc_text, user_frame_loc

IN_PLACE_OPERATORS = {
    "__iadd__": "+=",
    "__isub__": "-=",
    "__imul__": "*=",
    "__itruediv__": "/=",
    "__ifloordiv__": "//=",
    "__imod__": "%=",
    "__ipow__": "**=",
    "__imatmul__": "@=",
    "__iand__": "&=",
    "__ior__": "|=",
    "__ixor__": "^=",
    "__ilshift__": "<<=",
    "__irshift__": ">>=",
}

IDIOM = (
    "To update parameters, use an optimizer, which returns new tensors:\n"
    "    opt = bp.optim.sgd(0.1)   # or bp.optim.adam(1e-3)\n"
    "    state = opt.init(params)\n"
    "    params, state = opt.update(grads, state, params)\n"
    "or build the new value explicitly: p = p - lr * g"
)


def _raiser(symbol: str):
    def in_place(self, other):
        raise TypeError(
            f"`tensor {symbol} ...` at {loc_text(user_frame_loc())}: backplan tensors are "
            "immutable (saved buffers can never change behind the graph's back), so an "
            f"in-place {symbol} would silently rebind the name instead of updating the tensor.\n"
            + IDIOM
        )

    in_place.__name__ = f"in_place_{symbol}"
    return in_place


def install(cls) -> None:
    for name, symbol in IN_PLACE_OPERATORS.items():
        setattr(cls, name, _raiser(symbol))
