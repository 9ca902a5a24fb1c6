"""`python -m backplan <command>`: demo, and the commands other parts of backplan add."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backplan")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train a small MLP and print its backward plan")
    demo.add_argument("--steps", type=int, default=200)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run

        run(steps=args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
