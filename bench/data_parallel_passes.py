"""The 2-rank data-parallel table of BENCHMARKS 35 in passes: per pass one rank
(`taskset -c 0`), then two ranks (`mpiexec -n 2 -bind-to core`) of `bench.data_parallel` for
each installation named, then, with --ddp, PyTorch DDP (`bench.data_parallel_torch`), every
process with one thread (BLAS, OpenMP, Numba). Passes interleave the installations, so drift in
a shared box's speed hits all of them; the load and time are printed before each process.

    python -m backplan.bench.data_parallel_passes --model mlp --passes 3 --ddp
    python -m backplan.bench.data_parallel_passes --model mlp --passes 4 --zero \\
        --site /path/before --site /path/after

--site DIR runs the two ranks with DIR first on PYTHONPATH (a package copy, as
`python -m backplan.bench.data_parallel_passes --copy REV DIR`, run inside a checkout, lays one
out from a revision of it); without --site, this installation. The one-rank and DDP processes
use this installation. Processes start outside any checkout, so `python -m` imports the
installation asked for, not the folder it was started in.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
KEPT = ("step", "CPU", "the step against", "rank 0's step", "wait after", "adam", "ZeRO-1")
# where each package of the installed layout lives in a checkout ([tool.setuptools.package-dir])
SUBPACKAGES = (
    "ir",
    "codegen",
    "runtime",
    "tracer",
    "report",
    "artifacts",
    "optim",
    "bench",
    "distributed",
    "interop",
)


def pass_commands(
    model: str,
    rounds: int,
    repeats: int,
    sites: list[str],
    ddp: bool = False,
    zero: bool = False,
    python: str = sys.executable,
) -> list[tuple[str, list[str], dict[str, str]]]:
    """(label, argv, environment additions) of one pass, in the order they run."""
    tail = ["--model", model, "--rounds", str(rounds), "--repeats", str(repeats)]
    bench = [python, "-m", "backplan.bench.data_parallel", *tail]
    mpi = ["mpiexec", "-n", "2", "-bind-to", "core"]
    found = [("1 rank", ["taskset", "-c", "0", *bench], dict(ONE_THREAD))]
    for site in sites or [None]:
        env = dict(ONE_THREAD)
        if site is not None:
            env["PYTHONPATH"] = os.pathsep.join(
                [site, *filter(None, [os.environ.get("PYTHONPATH")])]
            )
        label = "2 ranks" + (f" ({site})" if site else "")
        found.append((label, [*mpi, *bench, *(["--zero"] if zero else [])], env))
    if ddp:
        torch = [python, "-m", "backplan.bench.data_parallel_torch", *tail]
        found.append(("DDP 2 ranks", [*mpi, *torch], dict(ONE_THREAD)))
    return found


def kept_lines(output: str) -> list[str]:
    """The lines of a run's output that the tables quote (times, CPU, parts, adam, ZeRO-1)."""
    return [line for line in output.splitlines() if line.startswith(KEPT)]


def lay_out_package(revision: str, dest: str, repository: str = ".") -> str:
    """A package copy of `revision`: dest/backplan as installed (the checkout's backplan/ with
    each subpackage folder inside it), for PYTHONPATH. Returns dest."""
    raw = os.path.join(dest, "raw")
    os.makedirs(raw)
    archive = subprocess.run(
        ["git", "-C", repository, "archive", revision], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", raw], input=archive.stdout, check=True)
    package = os.path.join(dest, "backplan")
    os.rename(os.path.join(raw, "backplan"), package)
    for name in SUBPACKAGES:
        if os.path.isdir(os.path.join(raw, name)):
            os.rename(os.path.join(raw, name), os.path.join(package, name))
    subprocess.run(["rm", "-rf", raw], check=True)
    return dest


def _load() -> str:
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("mlp", "transformer"), default="mlp")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=None, help="mlp 8, transformer 5")
    parser.add_argument("--repeats", type=int, default=None, help="mlp 5, transformer 3")
    parser.add_argument("--site", action="append", default=[], help="a package copy's folder")
    parser.add_argument("--ddp", action="store_true", help="also PyTorch DDP on 2 ranks")
    parser.add_argument("--zero", action="store_true", help="also adam, unsharded and ZeRO-1")
    parser.add_argument(
        "--copy",
        nargs=2,
        metavar=("REV", "DIR"),
        help="lay out REV of the checkout here as a package copy in DIR",
    )
    args = parser.parse_args(argv)
    if args.copy:
        print(lay_out_package(args.copy[0], args.copy[1]))
        return 0
    rounds = args.rounds or (8 if args.model == "mlp" else 5)
    repeats = args.repeats or (5 if args.model == "mlp" else 3)
    commands = pass_commands(args.model, rounds, repeats, args.site, args.ddp, args.zero)
    for n in range(1, args.passes + 1):
        print(f"== pass {n} load {_load()} {time.strftime('%H:%M:%S', time.gmtime())} UTC")
        for label, command, extra in commands:
            print(f"-- {label} load {_load()}", flush=True)
            done = subprocess.run(
                command,
                capture_output=True,
                text=True,
                env={**os.environ, **extra},
                cwd=tempfile.gettempdir(),  # outside any checkout (see the docstring)
            )
            print("\n".join(kept_lines(done.stdout + done.stderr)) or done.stderr[-2000:])
    print(f"end {time.strftime('%H:%M:%S', time.gmtime())} UTC load {_load()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
