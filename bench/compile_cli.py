"""`python -m backplan bench compile`: the compile-time record (bench/compile_time.py) for the
models and peers asked for, printed as a table and optionally written to JSON and to its own
generated part of BENCHMARKS.md.

    python -m backplan bench compile --models mlp,lstm12 --threads 1 --rounds 3
    python -m backplan bench compile --from-json compile.json --markdown BENCHMARKS.md
"""

from __future__ import annotations

import os
import sys
import time
from importlib import metadata

from .affinity import cpu_list_text, current_affinity, pin_process
from .compile_time import PEERS, check_rounds, measure_rounds, thread_variables
from .environment import collect, load_average
from .errors import BenchError
from .models import select_models
from .peers import AGAINST_CHOICES
from .peers import PEERS as PEER_CLASSES
from .progress import Progress
from .report.compile_table import render_lines, update_compile_markdown
from .report.export import read_json, write_json

SCHEMA = "backplan-bench-compile/1"
DEFAULT_AGAINST = "torch.compile,jax"
DEFAULT_ROUNDS = 3
# Options of the step-time run that mean nothing here; named in the error.
STEP_ONLY = ("quick", "cold_caches", "csv", "plot")


def run(args, out=None) -> int:
    out = out if out is not None else sys.stdout
    try:
        _reject_step_options(args)
        record = read_json(args.from_json, SCHEMA) if args.from_json else measure(args)
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(render_lines(record)), file=out)
    write_outputs(record, args)
    return 0 if all(r["status"] in ("ok", "skipped") for r in record["results"]) else 1


def write_outputs(record: dict, args) -> None:
    if args.json:
        write_json(record, args.json)
    if args.markdown:
        update_compile_markdown(record, args.markdown)


def measure(args) -> dict:
    progress = Progress(enabled=not args.quiet)
    models = select_models(_names(args.models))
    peers, skipped = compile_peers(args.against, progress)
    rounds = check_rounds(args.rounds if args.rounds is not None else DEFAULT_ROUNDS)
    pinned = pin_process(args.threads)  # the children inherit the CPU list
    settings = {"rounds": rounds, "small": args.small, "dtype": args.dtype, "threads": args.threads}
    if args.small:
        progress.note("--small: every model runs at SHRUNK sizes, not the documented ones")
    record = {
        "schema": SCHEMA,
        "command": command_line(args),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "run": {
            **settings,
            "rounds_done": 0,
            "models": [m.name for m in models],
            "peers": peers,
            "child_variables": thread_variables(args.threads),
            # set: every child shares one library folder (compiled once); unset: cold each time
            "library_cache": os.environ.get("BACKPLAN_LIBRARY_CACHE_DIR"),
            # a library built ahead of time (`cache prebuild`): the children load from it
            "prebuilt_library": prebuilt_library_found(),
        },
        "environment": collect(installed_versions(peers), pinned, load_average()),
        "affinity_text": cpu_list_text(current_affinity()),
        "models": [{"name": m.name, "summary": m.summary} for m in models],
        "skipped_peers": skipped,
    }
    start = time.perf_counter()
    skipped_rows = [
        {"model": m.name, "peer": s["peer"], "status": "skipped", "note": s["reason"]}
        for m in models
        for s in skipped
    ]

    def on_round(rows: list[dict], rounds_done: int) -> None:
        record["run"]["rounds_done"] = rounds_done
        record["elapsed_s"] = time.perf_counter() - start
        record["environment"]["load_average_1min"]["end"] = load_average()
        record["results"] = rows + skipped_rows
        if rounds_done < rounds:
            write_outputs(record, args)

    cells = [(m.name, p) for m in models for p in peers]
    on_round(measure_rounds(cells, settings, progress, on_round), rounds)
    progress.done()
    return record


def installed_versions(peers: list[str]) -> dict[str, str]:
    """Versions from the installed metadata: importing torch or jax here would not change the
    children, but costs seconds."""
    names = {"backplan": ["backplan", "numba"], "torch": ["torch"], "jax": ["jax", "jaxlib"]}
    wanted = dict.fromkeys(d for p in peers for d in names[p.split(".")[0]])
    versions = {}
    for name in wanted:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def compile_peers(against: str, progress) -> tuple[list[str], list[dict]]:
    """backplan first, then the peers --against names that can compile; those not installed
    are skipped with a note (so the record says why a column is missing)."""
    names = [] if against.strip() == "none" else _names(against)
    unknown = [n for n in names if n not in AGAINST_CHOICES]
    if unknown:
        raise BenchError(
            f"unknown peer(s) {', '.join(unknown)} in --against; choose from "
            f"{', '.join(n for n in AGAINST_CHOICES if n != 'backplan.reference')} (or 'none')"
        )
    wanted = ["backplan"] + [p for n in names for p in AGAINST_CHOICES[n] if p in PEERS]
    peers, skipped = [], []
    for name in dict.fromkeys(wanted):
        reason = PEER_CLASSES[name]().missing()
        if reason:
            skipped.append({"peer": name, "reason": reason})
            progress.note(f"skipping {name}: {reason}")
        else:
            peers.append(name)
    return peers, skipped


def _reject_step_options(args) -> None:
    used = [name for name in STEP_ONLY if getattr(args, name, None)]
    if used:
        flags = ", ".join("--" + name.replace("_", "-") for name in used)
        raise BenchError(
            f"{flags} belong to the step-time run, not to 'bench compile' (which always starts "
            "fresh processes with empty caches); drop them or run 'bench' without 'compile'"
        )


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def command_line(args) -> str:
    parts = ["python -m backplan bench compile"]
    defaults = {"models": "", "against": DEFAULT_AGAINST, "dtype": "float32"}
    for flag in ("models", "against", "dtype", "threads", "rounds"):
        value = getattr(args, flag)
        if value is not None and value != defaults.get(flag):
            parts.append(f"--{flag} {value}")
    parts += ["--small"] if args.small else []
    parts += [
        f"--{flag} {getattr(args, flag)}" for flag in ("json", "markdown") if getattr(args, flag)
    ]
    return " ".join(parts)


def prebuilt_library_found() -> str | None:
    """The prebuilt library folder the children will load from, or None (none built, none
    usable, or BACKPLAN_PREBUILT_LIBRARY_DIR names an empty one)."""
    from .internals import prebuilt_library

    folder = prebuilt_library.prebuilt_folder()
    if not prebuilt_library.usable(folder):
        return None
    has_files = any(names for _, _, names in os.walk(folder))
    return folder if has_files else None
