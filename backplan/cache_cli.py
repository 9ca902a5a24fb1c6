"""`python -m backplan cache {info,clear,prebuild}`: where the kernel cache is, what it holds, and
a way to empty it. Only files backplan names (`bp_*` plans, `k_*` shared loop kernels, and
Numba's files for them, and the library's signed machine code under `library/`) are touched, so
a cache folder pointed at a shared place loses nothing else. `prebuild` compiles the library
ahead of time into the installation's prebuilt folder (backplan/prebuild.py), which `clear`
leaves alone (`prebuild --clear` empties it)."""

from __future__ import annotations

import os

from backplan.codegen.build.cache import cache_dir
from backplan.codegen.build.library_cache import library_folder
from backplan.codegen.build.prebuilt_library import prebuilt_folder

PREFIXES = ("bp_", "k_")  # plan modules, shared loop kernels


def add_arguments(parser) -> None:
    parser.add_argument(
        "action",
        choices=("info", "clear", "prebuild"),
        help="show or empty the cache, or compile the library ahead of time",
    )
    parser.add_argument("--models", help="prebuild: comma-separated bench models (default all)")
    parser.add_argument(
        "--dtypes", default="float32,float64", help="prebuild: comma-separated dtypes"
    )
    parser.add_argument(
        "--drivers",
        default="python",
        help="prebuild: driver tiers to run the models on (python, inline: slower, compiles the "
        "plans' drivers too)",
    )
    parser.add_argument(
        "--clear", action="store_true", help="prebuild: empty the prebuilt folder instead"
    )


def cache_files(directory: str) -> list[str]:
    """Every file of the cache: generated modules, their keys, and Numba's machine code."""
    found = []
    for folder in (directory, os.path.join(directory, "__pycache__")):
        if os.path.isdir(folder):
            found += [
                os.path.join(folder, name)
                for name in sorted(os.listdir(folder))
                if name.startswith(PREFIXES) and os.path.isfile(os.path.join(folder, name))
            ]
    return found + library_files()


def library_files(top: str | None = None) -> list[str]:
    """The library functions' machine code (codegen/build/library_cache.py) under top (the
    library folder by default): Numba's signed index and data files, nothing else that may sit
    in that folder."""
    found = []
    for folder, _, names in os.walk(top or library_folder()):
        found += [
            os.path.join(folder, name)
            for name in sorted(names)
            if name.endswith(".bp.nbi") or (".bp." in name and name.endswith(".nbc"))
        ]
    return found


def _count(number: int, noun: str) -> str:
    """'1 compiled plan', '4 compiled plans': the line a user reads says what it counts."""
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


def _size_text(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:,} B" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return ""


def prebuild(args) -> int:
    """Compile the library into the prebuilt folder, or empty it (--clear)."""
    from backplan import prebuild as builder

    folder = prebuilt_folder()
    if args.clear:
        files = library_files(folder)
        for path in files:
            os.unlink(path)
        print(f"removed {len(files)} files of the prebuilt library from {folder}")
        return 0
    models = args.models.split(",") if args.models else builder.default_models()
    dtypes = args.dtypes.split(",")
    drivers = args.drivers.split(",")
    refused = (
        _unknown(models, builder.default_models(), "model")
        + _unknown(dtypes, builder.DTYPES, "dtype")
        + _unknown(drivers, builder.DRIVER_CHOICES, "driver")
    )
    if refused:  # before any child process starts: each would fail on it, minutes in
        print("cache prebuild: " + "; ".join(refused))
        return 2
    print(f"compiling the library for {', '.join(models)} ({', '.join(dtypes)}) into {folder}")
    failed = builder.build(folder, models, dtypes, tuple(drivers))
    print(f"prebuilt library: {len(library_files(folder))} files in {folder}")
    return 1 if failed else 0


def _unknown(names: list[str], known, what: str) -> list[str]:
    """A sentence per name `prebuild` cannot build for, naming the ones it can."""
    return [
        f"unknown {what} {name!r}: --{what}s takes a comma-separated list of " + ", ".join(known)
        for name in names
        if name not in known
    ]


def run(args) -> int:
    if args.action == "prebuild":
        return prebuild(args)
    directory = cache_dir()
    files = cache_files(directory)
    sources = [os.path.basename(f) for f in files if os.path.dirname(f) == directory]
    sources = [name for name in sources if name.endswith(".py")]
    # a plan's module (bp_*) and a loop kernel shared by plans (k_*) are both .py files: the
    # count said "14 compiled plans" for 4 plans and their 10 loops
    kernels = sum(1 for name in sources if name.startswith("k_"))
    plans = _count(len(sources) - kernels, "compiled plan")
    entries = f"{plans}, {_count(kernels, 'shared loop kernel')}"
    nbytes = sum(os.path.getsize(f) for f in files)
    if args.action == "info":
        print(f"kernel cache: {directory}")
        origin = "BACKPLAN_CACHE_DIR" if os.environ.get("BACKPLAN_CACHE_DIR") else "default"
        print(f"  set by: {origin}")
        library = len(library_files())
        plan_files = len(files) - library
        print(f"  entries: {entries} ({plan_files} files)")
        print(f"  library: {library} files of compiled library functions in {library_folder()}")
        prebuilt = len(library_files(prebuilt_folder())) if os.path.isdir(prebuilt_folder()) else 0
        print(f"  prebuilt library: {prebuilt} files in {prebuilt_folder()} (kept by clear)")
        print(f"  size: {_size_text(nbytes)}")
        return 0
    for path in files:
        os.unlink(path)
    summary = f"{entries} ({len(files)} files, {_size_text(nbytes)})"
    print(f"removed {summary} from {directory}")
    return 0
