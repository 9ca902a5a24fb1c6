"""The loop of an address kernel with its views written out: every read of a view becomes a
load at an address and an index, every write a store, with the index arithmetic in the source.
Numba then lowers no array views and no array indexing: on the fused loops of an unrolled LSTM
that cut a kernel's compile by about 40% (0.21 -> 0.13 s, same box), at the same loop speed.

Each view becomes its origin (`p3 = origin(a3, o3, np.float32)`: a typed pointer to its first
element, codegen/kernels/views.py), and loads and stores index from it. Works on the canonical
kernel
body (codegen/render/kernel_source.py), whose views are made once at the top
(`w3 = contiguous_view(a3, o3, (n0, n1,))`, or `strided_view(..., (d3, d4,))` with byte
strides) and indexed by loop variables or 0 (`w3[i0, i1]`); `w3[:] = x` fills a view.
Anything else that mentions a view leaves the body as it was (None).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_VIEW = re.compile(
    r"^\s*(w\d+) = (contiguous|strided)_view\((a\d+), (o\d+), \(([^()]*)\)(?:, \(([^()]*)\))?\)$"
)
_ACCESS = re.compile(r"\b(w\d+)\[([^\[\]]*)\]")
_STORE = re.compile(r"^(\s*)(w\d+)\[([^\[\]]*)\] (\+?=) (.*)$")
_VIEW_NAME = re.compile(r"\bw\d+\b")


@dataclass(frozen=True)
class _View:
    origin: str  # the pointer to its first element, made once at the top (p3)
    sizes: tuple[str, ...]
    strides: tuple[str, ...] | None  # bytes, for a strided view; None: C-contiguous

    def place(self, index: str) -> tuple[str, str]:
        """(function suffix, offset from the origin) of the element at `index` ("i0, i1")."""
        items = [item.strip() for item in index.split(",") if item.strip()]
        if len(items) != len(self.sizes):
            raise _NotWritable(index)
        if self.strides is None:
            linear = items[0]
            for size, item in zip(self.sizes[1:], items[1:], strict=True):
                if linear == "0":
                    linear = item
                else:
                    linear = f"({linear}) * {size}" + (f" + {item}" if item != "0" else "")
            return "", linear
        terms = [
            f"{item} * {stride}"
            for item, stride in zip(items, self.strides, strict=True)
            if item != "0" and stride != "0"
        ]
        return "_bytes", " + ".join(terms) or "0"

    def load(self, index: str) -> str:
        suffix, where = self.place(index)
        return f"load{suffix}({self.origin}, {where})"

    def store(self, index: str, value: str) -> str:
        suffix, where = self.place(index)
        return f"store{suffix}({self.origin}, {where}, {value})"


class _NotWritable(Exception):
    """The body uses a view in a way this rewrite does not cover."""


def _items(text: str | None) -> tuple[str, ...]:
    return tuple(item.strip() for item in (text or "").split(",") if item.strip())


def loads_and_stores(body: list[str], dtypes: dict[str, str]) -> list[str] | None:
    """body with its views as loads and stores; dtypes: array parameter -> NumPy type name.
    None where the body does something else with a view."""
    views: dict[str, _View] = {}
    out: list[str] = []
    try:
        for line in body:
            view = _VIEW.match(line)
            if view:
                name, kind, address, offset, sizes, strides = view.groups()
                origin = "p" + name[1:]
                out.append(f"{origin} = origin({address}, {offset}, {dtypes[address]})")
                views[name] = _View(
                    origin, _items(sizes), _items(strides) if kind == "strided" else None
                )
                continue
            out += _rewrite(line, views)
    except _NotWritable:
        return None
    if any(_VIEW_NAME.search(line) for line in out):
        return None
    return out


def _rewrite(line: str, views: dict[str, _View]) -> list[str]:
    def loaded(text: str) -> str:
        return _ACCESS.sub(lambda m: _view(views, m.group(1)).load(m.group(2)), text)

    store = _STORE.match(line)
    if store is None:
        return [loaded(line)]
    pad, name, index, operator, value = store.groups()
    view = _view(views, name)
    if index.strip() == ":":  # a fill, of a C-contiguous view only
        if view.strides is not None or operator != "=":
            raise _NotWritable(line)
        count = " * ".join(view.sizes) if view.sizes else "1"
        return [
            f"{pad}for f_ in range({count}):",
            f"{pad}    store({view.origin}, f_, {loaded(value)})",
        ]
    value = loaded(value)
    if operator == "+=":
        value = f"{view.load(index)} + {value}"
    return [f"{pad}{view.store(index, value)}"]


def _view(views: dict[str, _View], name: str) -> _View:
    if name not in views:
        raise _NotWritable(name)
    return views[name]
