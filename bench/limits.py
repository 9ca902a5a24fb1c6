"""What a step could reach at most, so each peer's step time also reads as a rate against the
machine's limit: the model's arithmetic per step (backplan's count of its forward and backward
graphs, the same number for every peer) and the measured FMA peak of the cores the run uses.

The peak is measured once per CPU model, vector width and Numba version (about a second) and
kept in a JSON file in backplan's cache folder; delete the file to measure it again.

    >>> limit = Limit(flops_per_core=100.0, width=512, threads=2, measured="cached")
    >>> limit.gflops
    200.0
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass

from .environment import cpu_name, cpu_signature

PEAK_FILE = "bench-fma-peak.json"


@dataclass(frozen=True)
class Limit:
    flops_per_core: float  # f32 GFLOP/s of one core's vector FMAs, as measured
    width: int  # bits of the vectors measured (the GEMM micro-kernel's width)
    threads: int  # cores the run uses
    measured: str  # "now" or "cached"

    @property
    def gflops(self) -> float:
        return self.flops_per_core * self.threads

    def to_dict(self) -> dict:
        return {**asdict(self), "gflops": self.gflops}


def model_flops(spec, inputs) -> int:
    """FLOPs of one step of the model: its forward graph, and for a training model the backward
    graph that differentiates it with nothing recomputed (bp.compile(remat=False)). Matmuls,
    convolutions and attention are counted exactly; elementwise ops and reductions by their
    cost class (ir/flops.py), a small share of every bench model's total."""
    import backplan as bp

    from .internals import node_flops
    from .peers.backplan_peer import bench_function

    params = {k: bp.tensor(v, requires_grad=spec.train) for k, v in inputs.params.items()}
    batch = [bp.tensor(a) for a in inputs.batch(spec.train)]
    traced = bp.compile(bench_function(spec), remat=False).trace(params, *batch)
    plans = traced.program.plans
    graphs = [plans.forward.graph] + ([plans.backward.graph] if spec.train else [])
    return sum(node_flops(node) for graph in graphs for node in graph.nodes)


def measured_limit(threads: int) -> Limit:
    """The FMA peak of one core at the active ISA's width, from the cache file or measured now
    (the process should be pinned: the measurement runs on one thread)."""
    from numba import __version__ as numba_version

    from .internals import ISA_WIDTH, active_isa

    width = ISA_WIDTH[active_isa()]
    key = f"{cpu_name()} ({cpu_signature()}), {width}-bit f32 FMA, numba {numba_version}"
    path = _peak_path()
    known = _read(path)
    if isinstance(known.get(key), float):
        return Limit(known[key], width, threads, "cached")
    from .peak_flops import peak_gflops_f32

    per_core = peak_gflops_f32(width, seconds=0.002, samples=300)  # short samples, the best
    if path is not None:
        _write(path, {**known, key: per_core})
    return Limit(per_core, width, threads, "now")


def rate(flops: int | None, step_ms: float | None, limit: Limit | None) -> dict | None:
    """{gflops, peak_fraction} of a step of `flops` taking `step_ms`; None when unknown."""
    if not flops or not step_ms:
        return None
    gflops = flops / (step_ms * 1e-3) / 1e9
    return {"gflops": gflops, "peak_fraction": gflops / limit.gflops if limit else None}


def _peak_path() -> str | None:
    from .internals import cache_dir

    try:
        folder = cache_dir()
        os.makedirs(folder, exist_ok=True)
    except OSError:
        return None  # an unwritable cache folder: measure every run
    return os.path.join(folder, PEAK_FILE)


def _read(path: str | None) -> dict:
    """The cached peaks: plain JSON, anything else (missing, damaged) counts as empty."""
    if path is None:
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            found = json.load(f)
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _write(path: str, peaks: dict) -> None:
    """Replace the file at once (a rename), so a concurrent reader sees the old or the new."""
    try:
        handle, temporary = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".json")
        with os.fdopen(handle, "w", encoding="utf-8") as f:
            json.dump(peaks, f, indent=1, sort_keys=True)
        os.replace(temporary, path)
    except OSError:
        return  # not cached: the next run measures again
