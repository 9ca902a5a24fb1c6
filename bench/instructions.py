"""Instructions per step of two backplan installations, A and B, counted under callgrind: a
step-time comparison the machine's load cannot move. Wall-clock A/Bs on a shared box resolve
a few percent at best (bench.revisions); the number of instructions a step executes is the same
whatever else runs, so a 1% change per call shows as 1%.

Each side runs one child process under ``valgrind --tool=callgrind --instr-atstart=no``: the
models are built and their kernels loaded from that side's warm cache without instrumentation,
then, per model, instrumentation starts, a few warm steps run, the counters are zeroed, N steps
run and callgrind dumps their counts (client requests issued by a few bytes of machine code,
so no compiler or valgrind header is needed). All threads count. A first process per side,
not under valgrind, fills its cache.

Valgrind runs the guest on a CPU without AVX-512 (it reports a Haswell-like AVX2 CPU), so
both the warming process and the counted one compile for the CPU valgrind reports (LLVM's
host name and features are set to it before backplan loads): the counted code is the AVX2
build of the same plans, and each side's cache is filled for that CPU.

Work done per unit of wall time, not per step, is over-counted: a step runs 50-400x slower
under callgrind, so the free-core sampler (codegen/run/free_cores.py, one /proc/stat read per
0.25 s, ~128k instructions) runs about once per counted cnn step instead of once per ~400.
`--env BACKPLAN_ADAPT_THREADS=0` leaves it out; the per-function diff of the kept dumps
(callgrind_annotate) names what differs.

    python -m backplan.bench.instructions --a /tmp/before/bin/python --b python \\
        --models mlp_tiny,cnn,ln_gelu
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import mmap
import os
import re
import shutil
import subprocess
import sys
import tempfile

# Callgrind's client requests (valgrind/callgrind.h: VG_USERREQ_TOOL_BASE('C','T') + n).
DUMP_STATS_AT, ZERO_STATS = 0x43540003, 0x43540001
START_INSTRUMENTATION, STOP_INSTRUMENTATION = 0x43540004, 0x43540005
RUNNING_ON_VALGRIND = 0x1001

# unsigned long request(unsigned long args[6] /* rdi */, unsigned long default /* rsi */):
# valgrind's amd64 client-request sequence (valgrind.h VALGRIND_DO_CLIENT_REQUEST_EXPR): rax
# points at the arguments, the four rotations of rdi (128 bits: rdi unchanged) and
# xchg rbx,rbx mark the request, rdx carries the result (the default when not under valgrind).
_REQUEST_CODE = bytes.fromhex(
    "4889f8"  # mov rax, rdi
    "4889f2"  # mov rdx, rsi
    "48c1c703"
    "48c1c70d"
    "48c1c73d"
    "48c1c733"  # rol rdi, 3 / 13 / 61 / 51
    "4887db"  # xchg rbx, rbx
    "4889d0"  # mov rax, rdx
    "c3"  # ret
)
_request = None

CALLGRIND = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--dump-instr=no", "-q"]
CALLGRIND += ["--dump-line=no", "--trace-children=no"]  # children (driver builds) run natively
DEFAULT_STEPS = {"mlp_tiny": 400, "cnn": 40, "ln_gelu": 4, "mlp": 4, "mlp_deep": 4}


def client_request(code: int, arg: int = 0, default: int = 0) -> int:
    """Issue a valgrind client request; returns `default` when not running under valgrind."""
    global _request
    if _request is None:
        import platform

        if platform.machine() not in ("x86_64", "AMD64") or not sys.platform.startswith("linux"):
            raise OSError(f"valgrind client requests here are x86-64 Linux's: {platform.machine()}")
        page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
        page.write(_REQUEST_CODE)
        address = ctypes.addressof(ctypes.c_char.from_buffer(page))
        function = ctypes.CFUNCTYPE(ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong)(address)
        _request = (page, function)  # the page lives as long as the function
    args = (ctypes.c_ulong * 6)(code, arg, 0, 0, 0, 0)
    return _request[1](ctypes.addressof(args), default)


def running_on_valgrind() -> bool:
    return client_request(RUNNING_ON_VALGRIND) > 0


def pin_host_cpu(cpu: str) -> None:
    """Make LLVM's host CPU (and so Numba's target, backplan's cache key and its GEMM width)
    the one valgrind's guest reports, "name;features", before backplan loads."""
    from llvmlite import binding

    name, features = cpu.split(";", 1)
    flags = {f[1:]: f[0] == "+" for f in features.split(",") if f}

    class Features(dict):
        def flatten(self, sort=True):
            return features

    binding.get_host_cpu_name = lambda: name
    binding.get_host_cpu_features = lambda: Features(flags)
    os.environ["NUMBA_CPU_NAME"], os.environ["NUMBA_CPU_FEATURES"] = name, features


def child(models: list[str], steps: dict[str, int], warm: int, cpu: str) -> dict:
    """Build the models; under valgrind count each one's N steps; print nothing else."""
    pin_host_cpu(cpu)
    import numpy as np

    from backplan.bench.internals import driver_builder
    from backplan.bench.models import MODELS
    from backplan.bench.peers import PEERS

    runners = {}
    for name in models:
        spec = MODELS[name]
        runners[name] = PEERS["backplan"]().build(spec, spec.inputs(False, np.dtype("float32")))
        runners[name].step()
    driver_builder.wait_for_builds()
    for name, runner in runners.items():
        counted(name, runner.step, steps[name], warm)
    return {"counted": running_on_valgrind()}


def counted(name: str, step, steps: int, warm: int) -> None:
    """Run `step` warm times, then (under callgrind) with instrumentation on warm more times
    (its code translated afresh), zero the counters, run it `steps` times and dump the counts
    labelled "backplan-steps NAME STEPS" (read_dumps reads them). Outside valgrind it only
    runs the steps."""
    counting = running_on_valgrind()
    for _ in range(warm):
        step()
    if counting:
        client_request(START_INSTRUMENTATION)
        for _ in range(warm):
            step()
        client_request(ZERO_STATS)
    for _ in range(steps):
        step()
    if counting:
        label = ctypes.create_string_buffer(f"backplan-steps {name} {steps}".encode())
        client_request(DUMP_STATS_AT, ctypes.addressof(label))
        client_request(STOP_INSTRUMENTATION)


def guest_cpu(python: str) -> str:
    """The CPU name and LLVM features valgrind's guest reports, "name;features"."""
    probe = (
        "import llvmlite.binding as b; "
        "print(b.get_host_cpu_name() + ';' + b.get_host_cpu_features().flatten())"
    )
    done = subprocess.run(
        ["valgrind", "--tool=none", "-q", python, "-I", "-c", probe],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip().splitlines()[-1]


def read_dumps(folder: str) -> dict[str, float]:
    """Instructions per step of each model counted in `folder` (read_events' Ir)."""
    return {name: events["Ir"] for name, events in read_events(folder).items()}


def read_events(folder: str) -> dict[str, dict[str, float]]:
    """Each event per step from callgrind's dumps: the 'desc: Trigger' line names the model and
    step count, 'events:' the events counted (Ir; with --cache-sim=yes also the data reads and
    writes and the misses of the first and last cache levels), 'summary:' (or 'totals:') the
    counts in that order."""
    counts, M = {}, re.M
    for path in sorted(glob.glob(os.path.join(folder, "callgrind.out*"))):
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        label = re.search(r"^desc: Trigger: Client Request: backplan-steps (\S+) (\d+)$", text, M)
        total = re.search(r"^(?:summary|totals):((?: \d+)+)", text, M)
        names = re.search(r"^events:((?: \w+)+)", text, M)
        if label and total:
            events = names.group(1).split() if names else ["Ir"]
            steps = int(label.group(2))
            numbers = [int(n) / steps for n in total.group(1).split()]
            counts[label.group(1)] = dict(zip(events, numbers, strict=False))
    return counts


def count(
    python: str,
    models: list[str],
    steps: dict[str, int],
    warm: int,
    cache: str,
    cpu: str,
    cpus: list[int],
    out: str,
    env_extra: dict[str, str],
    callgrind: tuple[str, ...] | list[str] = (),
) -> dict[str, dict[str, float]]:
    """Warm `cache` natively, then count under callgrind; events per step per model."""
    env = {
        **os.environ,
        **env_extra,
        "BACKPLAN_CACHE_DIR": cache,
        "BACKPLAN_QUIET": "1",
        "PYTHONHASHSEED": "0",
        "OPENBLAS_NUM_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "NUMBA_NUM_THREADS": "1",
    }
    command = [python, "-I", os.path.abspath(__file__), "--child", ",".join(models)]
    command += ["--steps-json", json.dumps(steps), "--warm", str(warm), "--cpu-model", cpu]
    pin = ["taskset", "-c", ",".join(map(str, cpus))]
    for wrapper in ([], [*CALLGRIND, *callgrind, f"--callgrind-out-file={out}/callgrind.out"]):
        done = subprocess.run(
            pin + wrapper + command,
            env=env,
            capture_output=True,
            text=True,
            cwd=tempfile.gettempdir(),
        )
        if done.returncode != 0:
            raise SystemExit(f"{python}: exit {done.returncode}: {done.stderr.strip()[-800:]}")
    return read_events(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", help="the Python of installation A (the one before)")
    parser.add_argument("--b", default=sys.executable, help="the Python of installation B")
    parser.add_argument("--models", default="mlp_tiny,cnn,ln_gelu")
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"counted steps per model (default: {DEFAULT_STEPS}, else 10)",
    )
    parser.add_argument("--warm", type=int, default=3, help="uncounted steps before counting")
    parser.add_argument("--repeat", type=int, default=1, help="counted processes per side")
    parser.add_argument(
        "--cpu", type=int, help="the CPU to pin to (default: the first this process may use)"
    )
    parser.add_argument("--keep", help="a folder to keep callgrind's dumps in (callgrind_annotate)")
    parser.add_argument("--cache-a", help="A's cache folder, kept (default: a new temporary one)")
    parser.add_argument("--cache-b", help="B's cache folder, kept (default: a new temporary one)")
    parser.add_argument(
        "--cache-sim",
        action="store_true",
        help="simulate the caches too: last-level misses per step beside the instructions "
        "(equal instructions and a wall-clock gap: memory layout?)",
    )
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for both sides")
    parser.add_argument("--steps-json", dest="steps_json", help=argparse.SUPPRESS)
    parser.add_argument("--cpu-model", help=argparse.SUPPRESS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        steps = json.loads(args.steps_json)
        print(json.dumps(child(args.child.split(","), steps, args.warm, args.cpu_model)))
        return 0
    if not args.a:
        parser.error("--a is required: the Python of the installation to compare against")
    if shutil.which("valgrind") is None:
        parser.error("valgrind is not installed (apt-get install valgrind)")
    if args.cpu is None:  # under `taskset -c 1` CPU 0 is not this process's to use
        args.cpu = min(os.sched_getaffinity(0))
    models = args.models.split(",")
    steps = {m: args.steps or DEFAULT_STEPS.get(m, 10) for m in models}
    env = dict(item.split("=", 1) for item in args.env)
    cpu = guest_cpu(args.a)
    keep = args.keep or tempfile.mkdtemp(prefix="backplan-instructions-")
    results: dict[str, list[dict]] = {"a": [], "b": []}
    caches = {
        side: given or tempfile.mkdtemp(prefix=f"backplan-instructions-cache-{side}-")
        for side, given in (("a", args.cache_a), ("b", args.cache_b))
    }
    for round_ in range(args.repeat):
        for side, python in (("a", args.a), ("b", args.b)):
            out = os.path.join(keep, f"{side}{round_}")
            os.makedirs(out, exist_ok=True)
            extra = ["--cache-sim=yes"] if args.cache_sim else []
            counts = count(
                python, models, steps, args.warm, caches[side], cpu, [args.cpu], out, env, extra
            )
            results[side].append(counts)
    print(f"events per step under callgrind, CPU as valgrind reports it: {cpu.split(';')[0]}")
    print(f"{'model':12} {'steps':>6} {'event':>6} {'A':>14} {'B':>14} {'B/A':>8}   ({keep})")
    shown = ("Ir", "D1mr", "DLmr", "DLmw") if args.cache_sim else ("Ir",)
    for name in models:
        for a, b in zip(results["a"], results["b"], strict=True):
            for event in shown:
                x, y = a[name].get(event, 0.0), b[name].get(event, 0.0)
                ratio = f"{y / x:8.4f}" if x else "       -"
                print(f"{name:12} {steps[name]:6d} {event:>6} {x:14.0f} {y:14.0f} {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
