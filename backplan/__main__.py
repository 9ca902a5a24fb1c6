"""`python -m backplan <command>`. Each command lives in its own module, which defines
`add_arguments(parser)` and `run(args) -> int`."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

COMMANDS = {
    "demo": ("backplan.demo", "train a small MLP with @compile and print its backward plan"),
    "bench": ("backplan.bench.cli", "measure backplan against NumPy, PyTorch and JAX"),
    "explain": ("backplan.explain_cli", "print the plan of a model defined in a file"),
    "export": ("backplan.export_cli", "write a self-contained artifact of a compiled model"),
    "inspect": ("backplan.inspect_cli", "print what an exported artifact holds"),
    "cache": ("backplan.cache_cli", "show where the kernel cache is and how big, or empty it"),
}
DESCRIPTION = (
    "backplan compiles numerical model functions into static forward and backward plans whose "
    "saved buffers, lifetimes and frees are known before anything runs."
)


def main(argv=None) -> int:
    from backplan import __version__

    parser = argparse.ArgumentParser(prog="python -m backplan", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"backplan {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, (module_name, help_text) in COMMANDS.items():
        if importlib.util.find_spec(module_name) is None:
            continue
        modules[name] = importlib.import_module(module_name)
        modules[name].add_arguments(commands.add_parser(name, help=help_text))
    args = parser.parse_args(argv)
    return modules[args.command].run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
