"""`python -m backplan export script.py:function --args "..." -o model.bpz`.

The argument spec lists every argument as `name=dtype[dims]` (a zero tensor; `:grad` makes it
require grad) or `name=<JSON literal>` (a static value: 3, 0.5, "mean", true). Dotted names build
dicts: `params.w0=f32[32,64]:grad` passes params={'w0': ...}. The spec is parsed, never evaluated;
the script itself is imported, as exporting it needs its code.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import json
import os
import re
import sys

import numpy as np

import backplan as bp
from backplan.artifacts.signing import read_key_file
from backplan.ir.types import DTYPES, np_dtype
from backplan.tracer.compile import CompiledFunction
from backplan.tracer.pytree import flatten

# every storage dtype by its short name (f32, bf16, u8, ...)
TENSOR_SPEC = re.compile(rf"^({'|'.join(DTYPES)})\[([\d,\s]*)\](:grad)?$")
NAME = re.compile(r"^[A-Za-z_]\w*(\.\w+)*$")


def add_arguments(parser) -> None:
    parser.add_argument("target", help="script.py:function or package.module:function")
    parser.add_argument("--args", default="", help='e.g. "x=f32[16,32],w=f32[32,8]:grad,n=3"')
    parser.add_argument(
        "--value-and-grad",
        action="store_true",
        help="export bp.value_and_grad(function) over the arguments marked :grad "
        "(a training step) instead of the function itself",
    )
    parser.add_argument("-o", "--output", required=True, help="artifact path, e.g. model.bpz")
    parser.add_argument(
        "--key-file",
        help="file holding a secret key: sign the artifact (HMAC-SHA256), so that "
        "`bp.load(path, key=...)` or `inspect --key-file` refuses any edit",
    )


def run(args) -> int:
    try:
        key = read_key_file(args.key_file) if args.key_file else None
        fn = load_target(args.target)
        arguments = parse_arg_spec(args.args)
        positional, keywords = split_arguments(fn, arguments)
        if args.value_and_grad:
            fn = bp.value_and_grad(fn, argnums=grad_argnums(positional))
        elif not isinstance(fn, CompiledFunction):
            fn = bp.compile(fn)
        path = bp.export(fn, *positional, path=args.output, key=key, **keywords)
    except (bp.BackplanError, TypeError) as exc:  # TypeError: arguments that do not bind
        print(f"export failed: {exc}", file=sys.stderr)
        return 1
    loaded = bp.load(path, key=key)
    print(f"wrote {path} ({os.path.getsize(path)} bytes)")
    print(f"signature: {loaded.signature}")
    print(f"authenticity: {loaded.authenticity.value}")
    return 0


def load_target(target: str):
    """Import script.py (or a module) and return its attribute; the script's folder goes on
    sys.path while it is imported, so its own imports work."""
    module_part, sep, attr = target.rpartition(":")
    if not sep or not module_part or not attr:
        raise bp.ExportError(f"target {target!r} must look like script.py:function")
    if module_part.endswith(".py"):
        module = _import_script(module_part)
    else:
        try:
            module = importlib.import_module(module_part)
        except ImportError as exc:
            raise bp.ExportError(f"cannot import {module_part}: {exc}") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise bp.ExportError(f"{module_part} has no attribute {attr!r}{_near(obj, part)}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise bp.ExportError(f"{target} is not a function")
    return obj


def _near(obj, name: str) -> str:
    """'; did you mean loss?' for a mistyped name, from the public names obj holds."""
    names = [n for n in dir(obj) if not n.startswith("_")]
    close = difflib.get_close_matches(name, names, n=3)
    return f"; did you mean {' or '.join(close)}?" if close else ""


def _import_script(path: str):
    if not os.path.isfile(path):
        raise bp.ExportError(f"no such script {path}")
    name = re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    folder = os.path.dirname(os.path.abspath(path))
    sys.path.insert(0, folder)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(folder)
    return module


def split_top_level(spec: str) -> list[str]:
    """Split on commas that are not inside brackets or quotes."""
    items, depth, quote, current = [], 0, None, []
    for char in spec:
        if quote:
            quote = None if char == quote else quote
        elif char in "\"'":
            quote = char
        elif char in "[{(":
            depth += 1
        elif char in "]})":
            depth -= 1
        elif char == "," and depth == 0:
            items.append("".join(current).strip())
            current = []
            continue
        current.append(char)
    if "".join(current).strip():
        items.append("".join(current).strip())
    return [item for item in items if item]


def parse_arg_spec(spec: str) -> dict:
    """{"x": Tensor, "params": {"w0": Tensor}, "n": 3} from the --args text."""
    arguments: dict = {}
    for item in split_top_level(spec):
        name, eq, value_text = item.partition("=")
        name = name.strip()
        if not eq or not NAME.match(name):
            raise bp.ExportError(f"--args item {item!r} must look like name=f32[2,3] or name=3")
        *parents, leaf = name.split(".")
        node = arguments
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise bp.ExportError(f"--args: {part} is both a value and a dict")
        if leaf in node:
            raise bp.ExportError(f"--args: {name} is given twice")
        node[leaf] = parse_value(value_text.strip(), name)
    return arguments


def parse_value(text: str, name: str):
    match = TENSOR_SPEC.match(text)
    if match:
        dims = [d.strip() for d in match.group(2).split(",") if d.strip()]
        shape = tuple(int(d) for d in dims)
        array = np.zeros(shape, dtype=np_dtype(match.group(1)))
        return bp.tensor(array, requires_grad=bool(match.group(3)))
    try:
        value = json.loads(text)
    except ValueError:
        raise bp.ExportError(
            f"--args {name}={text!r}: not a type like f32[2,3] (dtypes: {', '.join(DTYPES)}) "
            'or a literal (3, 0.5, "text", true)'
        ) from None
    if isinstance(value, list | dict) or value is None:
        raise bp.ExportError(f"--args {name}: only numbers, strings and booleans are literals")
    return value


def split_arguments(fn, arguments: dict) -> tuple[list, dict]:
    """Positional parameters in order (as far as given), the rest by keyword."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return [], dict(arguments)
    remaining = dict(arguments)
    positional = []
    for p in parameters:
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) or p.name not in remaining:
            break
        positional.append(remaining.pop(p.name))
    return positional, remaining


def grad_argnums(positional: list):
    """Positions whose leaves are all marked :grad; a mix inside one argument is refused."""
    nums = []
    for i, arg in enumerate(positional):
        leaves = flatten(arg)[0]
        flags = [isinstance(x, bp.Tensor) and x.requires_grad for x in leaves]
        if any(flags) and not all(flags):
            raise bp.ExportError(
                f"--value-and-grad: argument {i} mixes :grad and other leaves; "
                "mark all of its leaves :grad or none"
            )
        if flags and all(flags):
            nums.append(i)
    if not nums:
        raise bp.ExportError("--value-and-grad needs at least one argument marked :grad")
    return nums[0] if len(nums) == 1 else tuple(nums)
