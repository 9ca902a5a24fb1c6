"""The one text form of graphs and plans: printed for people, parsed back for tests and exports.

    graph @f(%0: f32[16,32] arg, %1: f32[32,8] arg) {
      %2 = matmul %0, %1 : f32[16,8]  # model.py:14
      %3 = sum %2 {axes=(0, 1), keepdims=False} : f32[]  # model.py:15
      free %2
      return %3
    }

Parsing never evaluates code: attribute values go through a literal-only reader.
"""

from __future__ import annotations

import ast
import re

from .builder import make_value
from .errors import BackplanError, ParseError, ShapeError
from .graph import Graph, Value
from .printer import format_attr, format_graph, format_loc, format_node, value_names
from .registry import get_op
from .shapes import check_size
from .types import DTYPES, TensorType

ROLES = ("arg", "cotangent", "saved")
__all__ = [  # printing lives in ir/printer.py; the text form's users import it from here
    "format_attr",
    "format_graph",
    "format_loc",
    "format_node",
    "value_names",
    "parse_graph",
    "parse_type",
    "parse_attrs",
]


# ---- parsing ----------------------------------------------------------------------------------

_HEADER = re.compile(r"^graph @([\w.]+)\((.*)\) \{$")
_PARAM = re.compile(r"^%(\d+): (\w+)\[([\d,]*)\] (\w+)$")
_TYPE = re.compile(r"^(\w+)\[([\d,]*)\]$")
_NODE = re.compile(r"^(%\d+) = (\w+)(.*?) : (\w+\[[\d,]*\])(?:  # (.+):(\d+))?$")


def parse_type(text: str) -> TensorType:
    match = _TYPE.match(text.strip())
    if not match or match.group(1) not in DTYPES:
        raise ParseError(f"bad type {text!r}")
    dims = match.group(2)
    shape = tuple(int(d) for d in dims.split(",")) if dims else ()
    try:
        check_size(shape)
    except ShapeError as exc:
        raise ParseError(f"bad type {text!r}: {exc}") from None
    return TensorType(match.group(1), shape)


def _literal(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float | str | bool | None):
        return node.value
    if isinstance(node, ast.Tuple | ast.List):
        return tuple(_literal(e) for e in node.elts)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _literal(node.operand)
        if isinstance(inner, int | float) and not isinstance(inner, bool):
            return -inner
    if isinstance(node, ast.Name) and node.id in ("inf", "nan"):
        return float(node.id)
    raise ParseError(f"attribute value {ast.dump(node)} is not a literal")


def parse_attrs(text: str) -> dict:
    if not text:
        return {}
    try:
        call = ast.parse(f"f({text})", mode="eval").body
    except SyntaxError as exc:
        raise ParseError(f"bad attributes {{{text}}}: {exc.msg}") from None
    if not isinstance(call, ast.Call) or call.args:
        raise ParseError(f"bad attributes {{{text}}}")
    names = [kw.arg for kw in call.keywords]
    if len(set(names)) != len(names):
        raise ParseError(f"bad attributes {{{text}}}: an attribute is given twice")
    return {kw.arg: _literal(kw.value) for kw in call.keywords}


def parse_graph(text: str, constants=None) -> tuple[Graph, dict[int, list[Value]]]:
    """Parse the text form back into a graph and its free statements, re-checking every node
    against the registry (types are re-derived and must match the printed ones)."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    if len(lines) < 3:
        raise ParseError("graph text is too short")
    header = _HEADER.match(lines[0].strip())
    if not header or lines[-1].strip() != "}":
        raise ParseError(f"bad graph header or footer: {lines[0]!r}")
    graph = Graph(name=header.group(1), constants=dict(constants or {}))
    env: dict[str, Value] = {}
    frees: dict[int, list[Value]] = {}
    params = header.group(2).strip()
    for part in re.split(r", (?=%)", params) if params else []:
        match = _PARAM.match(part.strip())
        if not match or match.group(4) not in ROLES:
            raise ParseError(f"bad parameter {part!r}")
        name = f"%{match.group(1)}"
        _define(
            env,
            name,
            graph.add_input(parse_type(f"{match.group(2)}[{match.group(3)}]"), role=match.group(4)),
        )
    returned = False
    for lineno, raw in enumerate(lines[1:-1], start=2):
        line = raw.strip()
        try:
            if returned and not line.startswith("free "):
                raise ParseError(f"only free statements may follow return, got {line!r}")
            if line.startswith("free "):
                step = len(graph.nodes) if returned else len(graph.nodes) - 1
                frees.setdefault(step, []).append(_lookup(env, line[5:].strip()))
            elif line.startswith("return"):
                names = line[6:].strip()
                graph.outputs = [_lookup(env, n.strip()) for n in names.split(",")] if names else []
                returned = True
            else:
                _parse_node(graph, env, line)
        except BackplanError as exc:
            raise ParseError(f"line {lineno}: {exc}") from None
    if not returned:
        raise ParseError("graph has no return statement")
    return graph, frees


def _define(env, name, value):
    if name in env:
        raise ParseError(f"{name} is defined twice")
    env[name] = value


def _lookup(env, name):
    if name not in env:
        raise ParseError(f"{name} is used before it is defined")
    return env[name]


def _parse_node(graph: Graph, env, line: str) -> None:
    match = _NODE.match(line)
    if not match:
        raise ParseError(f"cannot read {line!r}")
    name, op, rest, type_text, loc_file, loc_line = match.groups()
    get_op(op)
    rest = rest.strip()
    attrs = {}
    if rest.endswith("}") and "{" in rest:
        brace = rest.index("{")
        attrs = parse_attrs(rest[brace + 1 : -1])
        rest = rest[:brace].strip()
    inputs = [_lookup(env, n.strip()) for n in rest.split(",")] if rest else []
    loc = (loc_file, int(loc_line)) if loc_file else None
    value = make_value(op, inputs, attrs, loc)
    if value.type != parse_type(type_text):
        raise ParseError(f"{name}: printed type {type_text} but {op} gives {value.type}")
    if op == "const" and attrs.get("name") not in graph.constants:
        raise ParseError(f"{name}: constant {attrs.get('name')!r} is missing")
    _define(env, name, value)
    graph.nodes.append(value)
