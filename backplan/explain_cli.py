"""`python -m backplan explain script.py:function --args "x=f32[16,32],w=f32[32,8]:grad"`.

Imports the user's script (running its top level, as importing it would; its
`if __name__ == "__main__":` block does not run), builds zero-filled inputs of the described
shapes and dtypes, and prints the explain() report of the function; nothing of the model runs.

`--args` uses the same descriptions as `export` (repeat it to add more), parsed, never evaluated:
  name=f32[16,32]        a tensor: dtype (f32, f64, i64, bool) and shape ([] for a scalar)
  name=f32[16,32]:grad   a tensor that requires grad
  params.w0=f32[32,64]   a tensor inside a dict argument: params = {"w0": ...}
  name=3, name=0.5, name="mean", name=true
                         a static value (a JSON number, string or boolean)
`--value-and-grad` explains bp.value_and_grad(function) over the arguments marked :grad.
"""

from __future__ import annotations

import inspect
import re
import sys

import backplan as bp
from backplan.export_cli import grad_argnums, load_target, parse_arg_spec
from backplan.ir.errors import BackplanError


class ExplainArgumentError(BackplanError):
    """A bad `explain` command line: an argument the function needs, or one it does not have."""


def add_arguments(parser) -> None:
    parser.add_argument("target", help="path/to/script.py:function (or package.module:function)")
    parser.add_argument(
        "--args",
        action="append",
        default=[],
        metavar="SPECS",
        help='inputs, e.g. "x=f32[16,32],w=f32[32,8]:grad,params.b=f32[8]:grad"',
    )
    parser.add_argument(
        "--value-and-grad",
        action="store_true",
        help="explain bp.value_and_grad(function) over the arguments marked :grad",
    )
    parser.add_argument(
        "--torch",
        action="store_true",
        help="the target is a torch.nn.Module class (or instance): explain its training step "
        '(--args "x: f32[32,3,32,32]" describes forward\'s inputs)',
    )
    parser.add_argument(
        "--loss",
        default="sum",
        choices=("cross_entropy", "mse", "sum"),
        help="with --torch: the loss on the module's output (default: its sum)",
    )
    parser.add_argument("--plot", metavar="PATH", help="also write the timeline (.png or .svg)")
    parser.add_argument("--dot", metavar="PATH", help="also write the Graphviz DOT graph")


def run(args) -> int:
    try:
        fn = load_target(args.target)
        if args.torch:
            fn, positional, keywords = _torch_step(fn, ",".join(args.args), args.loss)
        else:
            positional, keywords = bind_specs(fn, parse_arg_spec(",".join(args.args)))
        if args.value_and_grad and not args.torch:
            fn = bp.value_and_grad(fn, argnums=grad_argnums(positional))
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


def _torch_step(target, spec: str, loss: str):
    """The training step of a torch.nn.Module (a class built with no arguments, an instance, or
    a function returning one) on the described inputs: `x: f32[...]` or `x=f32[...]`."""
    import torch

    from backplan.interop.torch.step import training_step  # torch only when asked for

    module = target() if not isinstance(target, torch.nn.Module) else target
    if not isinstance(module, torch.nn.Module):
        raise ExplainArgumentError(f"--torch: the target made a {type(module).__name__}, not a "
                                   "torch.nn.Module")  # fmt: skip
    inputs = parse_arg_spec(re.sub(r"(\w+)\s*:\s*(?=\w+\[)", r"\1=", spec))
    step, args = training_step(module, {k: v.numpy() for k, v in inputs.items()}, loss)
    return step, list(args), {}


def bind_specs(fn, tree: dict) -> tuple[list, dict]:
    """Positional and keyword arguments in the order of fn's parameters."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        raise ExplainArgumentError(f"cannot read the parameters of {fn!r}") from None
    names = [p.name for p in parameters]
    unknown = [name for name in tree if name not in names]
    if unknown and not any(p.kind == p.VAR_KEYWORD for p in parameters):
        raise ExplainArgumentError(
            f"{fn.__name__} has no parameter(s) {unknown}; its parameters are {names}"
        )
    positional, keywords, skipped = [], {}, False
    for p in parameters:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name not in tree:
            if p.default is inspect.Parameter.empty:
                raise ExplainArgumentError(
                    f"{fn.__name__}: describe parameter {p.name!r}, e.g. --args "
                    f'"{p.name}=f32[16,32]" (or "{p.name}.key=f32[...]" for a dict)'
                )
            skipped = True
        elif p.kind == p.POSITIONAL_ONLY or (p.kind == p.POSITIONAL_OR_KEYWORD and not skipped):
            positional.append(tree[p.name])  # by position, as value_and_grad's argnums counts
        else:
            keywords[p.name] = tree[p.name]
    keywords.update((name, tree[name]) for name in unknown)  # taken by **kwargs
    return positional, keywords
