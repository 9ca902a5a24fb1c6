"""`python -m backplan bench`: measure backplan against NumPy, PyTorch and JAX on the same
models in one process, interleaved, and print a table (optionally JSON, CSV, Markdown, plot).

    python -m backplan bench --quick
    python -m backplan bench --json results.json --markdown BENCHMARKS.md
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, replace

from . import compile_cli
from .affinity import pin_process
from .caches import FreshCaches
from .environment import collect, load_average, usable_cpus
from .errors import BenchError
from .measure import FULL, QUICK
from .models import MODELS, select_models
from .peers import AGAINST_CHOICES, select_peers
from .progress import Progress
from .report.export import SCHEMA, read_json, write_csv, write_json
from .report.markdown import update_markdown_file
from .report.plot import write_plot
from .report.table import render_text
from .suite import Settings, run_suite
from .threads import apply_threads, prepare_jax_threads

DEFAULT_AGAINST = "numpy,torch,jax"
# --quick leaves torch.compile out unless named: its cold compile (10-20 s a model, minutes for
# nine) was most of a quick run from empty caches.
QUICK_AGAINST = "numpy,torch.eager,jax"
FEW_CPUS = 4  # at or below this, default thread pools of several libraries fight for cores


def add_arguments(parser) -> None:
    parser.add_argument(
        "mode",
        nargs="?",
        default="steps",
        choices=("steps", "compile"),
        help="steps (default): step time, memory and first calls of every peer in one "
        "process; compile: cold and warm first calls, each in a fresh process with an empty "
        "cache folder (--models, --against, --threads, --rounds, --small, --json, --markdown)",
    )
    parser.add_argument(
        "--models", default="", help=f"comma-separated; default all of: {', '.join(MODELS)}"
    )
    parser.add_argument(
        "--against",
        default=None,
        help=f"peers, comma-separated, from {', '.join(AGAINST_CHOICES)}; "
        "'torch' means eager and torch.compile; 'none' runs backplan alone "
        f"(default {DEFAULT_AGAINST}; with --quick {QUICK_AGAINST}; for compile "
        "torch.compile,jax); peers not installed are skipped",
    )
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="pin the process to N CPUs before the peers load (XLA sizes its pool from "
        "that) and set every thread count: BLAS and OpenMP pools (with threadpoolctl), "
        "PyTorch, Numba, XLA's Eigen when 1 (default: leave the libraries alone)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a couple of steps per peer, no warm-compile or measured-peak "
        "measurement, no wait for backplan's compiled drivers, torch.compile only when "
        "--against names it, backplan.from_torch the same",
    )
    parser.add_argument(
        "--small",
        action="store_true",
        help="shrink every model's shapes (for tests); results say so",
    )
    parser.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds")
    parser.add_argument(
        "--cold-caches",
        action="store_true",
        help="give backplan and torch.compile empty disk caches in this process, "
        "so cold first calls compile everything (default: caches as found)",
    )
    parser.add_argument("--json", metavar="PATH", help="write every measured field as JSON")
    parser.add_argument("--csv", metavar="PATH", help="write one row per model and peer")
    parser.add_argument(
        "--markdown",
        metavar="PATH",
        help="write or update the generated part of a Markdown file (BENCHMARKS.md)",
    )
    parser.add_argument("--plot", metavar="PATH", help="bar chart of step times (matplotlib)")
    parser.add_argument(
        "--from-json", metavar="PATH", help="report a saved JSON record instead of measuring"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def run(args, out=None) -> int:
    if args.mode == "compile":
        if args.against is None:
            args.against = compile_cli.DEFAULT_AGAINST
        return compile_cli.run(args, out)
    if args.against is None:
        args.against = _default_against(args)
    out = out if out is not None else sys.stdout
    try:
        record = read_json(args.from_json) if args.from_json else measure(args)
        print(render_text(record), file=out)
        write_outputs(record, args)
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0 if all(r["status"] in ("ok", "skipped") for r in record["results"]) else 1


def measure(args) -> dict:
    with FreshCaches(args.cold_caches) as caches:
        record = _measure(args)
        record["run"]["caches"] = caches.describe()
    return record


def _measure(args) -> dict:
    progress = Progress(enabled=not args.quiet)
    models = select_models(_names(args.models))
    against = [] if args.against.strip() == "none" else _names(args.against)
    peers = select_peers(against, imported_with_torch=not args.quick)
    thread_settings = pin_process(args.threads)  # before any peer imports its library
    thread_settings |= prepare_jax_threads(args.threads, any(p.name == "jax" for p in peers))
    available, skipped = _available(peers, progress)
    versions = {k: v for peer in available for k, v in peer.versions().items()}
    thread_settings |= apply_threads(args.threads)
    settings = replace(_settings(args), limit=_limit(args, progress))
    if args.threads is None and usable_cpus() <= FEW_CPUS:
        progress.note(
            f"note: thread counts are the libraries' defaults on {usable_cpus()} CPUs; "
            "interleaved peers' thread pools can stall each other there, so use "
            "--threads 1 for steady numbers"
        )
    if settings.small:
        progress.note("--small: every model runs at SHRUNK sizes, not the documented ones")
    started, load = time.strftime("%Y-%m-%d %H:%M:%S %Z"), load_average()
    start = time.perf_counter()
    with _quick_drivers(args.quick):
        results = run_suite(models, available, settings, progress)
    progress.done()
    return {
        "schema": SCHEMA,
        "command": command_line(args),
        "started": started,
        "elapsed_s": time.perf_counter() - start,
        "run": {
            "dtype": settings.dtype,
            "small": settings.small,
            "quick": args.quick,
            "schedule": asdict(settings.schedule),
            "warm_compile": settings.warm_compile,
        },
        "environment": collect(versions, thread_settings, load),
        "limit": settings.limit.to_dict() if settings.limit else None,
        "models": [
            {
                "name": m.name,
                "summary": m.summary,
                "train": m.train,
                "config": m.sizes(settings.small),
                "static": m.static,
            }
            for m in models
        ],
        "peers": [
            {"name": p.name, "description": p.description, "warm_first_call": p.warm_first_call}
            for p in available
        ],
        "skipped_peers": skipped,
        "results": results,
    }


@contextmanager
def _quick_drivers(quick: bool):
    """--quick runs backplan's plan drivers as Python (BACKPLAN_DRIVER=python) unless the
    environment picks a mode: it times a couple of steps without waiting for compiled drivers,
    and their background builds only took the cores from the peers compiling after them, then
    were stopped at exit (cold, lstm48's two drivers: 60 of 86 CPU s, and JAX's first call
    waited for the cores)."""
    if not quick or "BACKPLAN_DRIVER" in os.environ:
        yield
        return
    os.environ["BACKPLAN_DRIVER"] = "python"
    try:
        yield
    finally:
        os.environ.pop("BACKPLAN_DRIVER", None)


def _limit(args, progress):
    """The cores' FMA peak (bench/limits.py) for the threads the run uses, or None if it
    cannot be measured here (the rates' % of peak are then left out)."""
    from .limits import measured_limit

    threads = args.threads or usable_cpus()
    try:
        return measured_limit(threads)
    except Exception as exc:  # noqa: BLE001 - step times do not need it
        progress.note(f"note: no FMA peak measured ({type(exc).__name__}: {exc}); no % of peak")
        return None


def _available(peers, progress) -> tuple[list, list[dict]]:
    """The peers that can run here, and a note for each one that cannot."""
    available, skipped = [], []
    for peer in peers:
        reason = peer.missing()
        if reason:
            skipped.append({"peer": peer.name, "reason": reason})
            progress.note(f"skipping {peer.name}: {reason}")
        else:
            available.append(peer)
    return available, skipped


def _default_against(args) -> str:
    return QUICK_AGAINST if args.quick else DEFAULT_AGAINST


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def _settings(args) -> Settings:
    schedule = QUICK if args.quick else FULL
    if args.rounds is not None:
        if args.rounds < 1:
            raise BenchError(f"--rounds must be at least 1, got {args.rounds}")
        schedule = replace(schedule, rounds=args.rounds)
    return Settings(
        dtype=args.dtype,
        small=args.small,
        schedule=schedule,
        warm_compile=not args.quick,
        measure_peak=not args.quick,
        wait_for_drivers=not args.quick,
    )


def command_line(args) -> str:
    """The command that reproduces this run (outputs included)."""
    parts = ["python -m backplan bench"]
    for flag in ("models", "against", "dtype", "threads", "rounds"):
        value = getattr(args, flag)
        default = {"models": "", "against": _default_against(args), "dtype": "float32"}.get(flag)
        if value is not None and value != default:
            parts.append(f"--{flag} {value}")
    parts += [
        f"--{flag.replace('_', '-')}"
        for flag in ("quick", "small", "cold_caches")
        if getattr(args, flag)
    ]
    for flag in ("json", "csv", "markdown", "plot"):
        if getattr(args, flag):
            parts.append(f"--{flag} {getattr(args, flag)}")
    return " ".join(parts)


def write_outputs(record: dict, args) -> None:
    if args.json:
        write_json(record, args.json)
    if args.csv:
        write_csv(record, args.csv)
    if args.markdown:
        update_markdown_file(record, args.markdown)
    if args.plot:
        write_plot(record, args.plot)
