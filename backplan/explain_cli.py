"""`python -m backplan explain script.py:function --args "x=f32[16,32],w=f32[32,8]:grad"`.

Loads the user's script (running its top level, as importing it would; its
`if __name__ == "__main__":` block does not run), builds zero-filled inputs of the described
shapes and dtypes, and prints the explain() report of the function; nothing of the model runs.

Argument descriptions, separated by commas (repeat --args to add more):
  name=f32[16,32]        a tensor: dtype (f32, f64, i64, bool) and shape ([] for a scalar)
  name=f32[16,32]:grad   a tensor that requires grad
  params.w0=f32[32,64]   a tensor inside a dict argument: params = {"w0": ...}
  name=3, name=0.5, name=true
                         a static value: an int, a float, true/false or none
Values are read as these literals only; nothing in them is evaluated.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
import sys

import numpy as np

import backplan as bp
from backplan.ir.errors import BackplanError

DTYPES = {"f32": np.float32, "f64": np.float64, "i64": np.int64, "bool": np.bool_,
          "float32": np.float32, "float64": np.float64, "int64": np.int64}
TENSOR_SPEC = re.compile(r"^(\w+)\[([\d,\s]*)\](:grad)?$")
NAME_PATH = re.compile(r"^[A-Za-z_]\w*(\.\w+)*$")


class ExplainArgumentError(BackplanError):
    """A bad `explain` command line: the script, the function or an argument description."""


def add_arguments(parser) -> None:
    parser.add_argument("target", help="path/to/script.py:function (or package.module:function)")
    parser.add_argument("--args", action="append", default=[], metavar="SPECS",
                        help='inputs, e.g. "x=f32[16,32],w=f32[32,8]:grad,params.b=f32[8]:grad"')
    parser.add_argument("--plot", metavar="PATH", help="also write the timeline (.png or .svg)")
    parser.add_argument("--dot", metavar="PATH", help="also write the Graphviz DOT graph")


def run(args) -> int:
    try:
        fn = load_function(args.target)
        positional, keywords = bind_specs(fn, parse_specs(args.args))
        report = bp.explain(fn, *positional, **keywords)
        print(report)
        if args.dot:
            report.save_dot(args.dot)
            print(f"wrote {args.dot}")
        if args.plot:
            report.plot(args.plot)
            print(f"wrote {args.plot}")
    except BackplanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def load_function(target: str):
    """'dir/script.py:fn' or 'package.module:fn' -> the function object."""
    where, sep, attribute = target.rpartition(":")
    if not sep or not where or not attribute:
        raise ExplainArgumentError(f"{target!r}: give the function as path/to/script.py:function")
    module = _load_script(where) if where.endswith(".py") else _import_module(where)
    value = module
    for part in attribute.split("."):
        if not hasattr(value, part):
            raise ExplainArgumentError(f"{where} has no attribute {attribute!r}")
        value = getattr(value, part)
    if not callable(value):
        raise ExplainArgumentError(f"{where}:{attribute} is a {type(value).__name__}, "
                                   "not a function")
    return value


def _load_script(path: str):
    if not os.path.isfile(path):
        raise ExplainArgumentError(f"no such script: {path}")
    folder = os.path.dirname(os.path.abspath(path))
    name = "_backplan_explain_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, folder)  # so the script's own sibling imports work
    try:
        sys.modules[name] = module
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(folder)
    return module


def _import_module(name: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        raise ExplainArgumentError(f"cannot import {name!r}: {exc}") from None


def split_specs(text: str) -> list[str]:
    """Split at commas outside brackets: 'x=f32[2,3],y=3' -> ['x=f32[2,3]', 'y=3']."""
    items, depth, current = [], 0, ""
    for char in text:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    items.append(current)
    return [item.strip() for item in items if item.strip()]


def parse_specs(groups: list[str]) -> dict:
    """The argument tree the descriptions build: {'x': Tensor, 'params': {'w0': Tensor}}."""
    tree: dict = {}
    for item in (item for group in groups for item in split_specs(group)):
        path, sep, value_text = item.partition("=")
        path = path.strip()
        if not sep or not NAME_PATH.match(path):
            raise ExplainArgumentError(
                f"argument description {item!r} should look like name=f32[16,32] (or "
                "name=f32[16,32]:grad, params.w=f32[4,4], name=3)")
        *parents, leaf = path.split(".")
        node = tree
        for parent in parents:
            node = node.setdefault(parent, {})
            if not isinstance(node, dict):
                raise ExplainArgumentError(f"{path}: {parent} is already given a value")
        if leaf in node:
            raise ExplainArgumentError(f"{path} is described twice")
        node[leaf] = parse_value(path, value_text.strip())
    return tree


def parse_value(path: str, text: str):
    match = TENSOR_SPEC.match(text)
    if match:
        return _tensor(path, *match.groups())
    lowered = text.lower()
    if lowered in ("true", "false", "none"):
        return {"true": True, "false": False, "none": None}[lowered]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    raise ExplainArgumentError(
        f"{path}={text}: not a tensor description like f32[16,32] (dtypes: f32, f64, i64, "
        "bool) nor an int, float, true/false or none")


def _tensor(path: str, dtype: str, dims: str, grad: str | None):
    if dtype not in DTYPES:
        raise ExplainArgumentError(f"{path}: unknown dtype {dtype!r}; use f32, f64, i64 or bool")
    try:
        shape = tuple(int(d) for d in dims.split(",") if d.strip())
    except ValueError:
        raise ExplainArgumentError(f"{path}: bad shape [{dims}]") from None
    if grad and DTYPES[dtype] not in (np.float32, np.float64):
        raise ExplainArgumentError(f"{path}: only f32 and f64 tensors can require grad")
    return bp.tensor(np.zeros(shape, DTYPES[dtype]), requires_grad=bool(grad))


def bind_specs(fn, tree: dict) -> tuple[list, dict]:
    """Positional and keyword arguments in the order of fn's parameters."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        raise ExplainArgumentError(f"cannot read the parameters of {fn!r}") from None
    names = [p.name for p in parameters]
    unknown = [name for name in tree if name not in names]
    if unknown:
        raise ExplainArgumentError(f"{fn.__name__} has no parameter(s) {unknown}; its "
                                   f"parameters are {names}")
    positional, keywords, skipped = [], {}, False
    for p in parameters:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name not in tree:
            if p.default is inspect.Parameter.empty:
                raise ExplainArgumentError(
                    f"{fn.__name__}: describe parameter {p.name!r}, e.g. --args "
                    f'"{p.name}=f32[16,32]" (or "{p.name}.key=f32[...]" for a dict)')
            skipped = True
        elif p.kind == p.POSITIONAL_ONLY or (p.kind == p.POSITIONAL_OR_KEYWORD and not skipped):
            positional.append(tree[p.name])  # by position, as value_and_grad's argnums counts
        else:
            keywords[p.name] = tree[p.name]
    return positional, keywords
