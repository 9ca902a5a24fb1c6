"""Formatting shared by the text and Markdown reports."""

from __future__ import annotations

from ..affinity import cpu_list_text

MIB = 1024 * 1024
NOISY_SPREAD = 2.0  # median over min step time above which a row is flagged as noisy

COLUMNS = (
    "peer",
    "median ms",
    "min ms",
    "max ms",
    "x fastest",
    "GFLOP/s (% peak)",
    "1st call s cold/warm",
    "saved MiB excl/incl",
    "peak MiB measured/plan",
    "max rel err",
    "check",
)


LEGEND = (
    "median/min/max: step time over the timed steps (forward + backward, or forward only); "
    "x fastest: median over the fastest correct peer's median for that model",
    "GFLOP/s: the model's FLOPs per step (backplan's count of its forward and backward graphs, "
    "the same for every peer) over the median step; % peak: of the measured FMA peak of the "
    "cores the run uses (the limit line above)",
    "1st call: cold = the first call in this process (tracing, compiling); warm = a second "
    "first call once the peer's compiler is warm (per peer below)",
    "saved: bytes kept from forward for backward, excluding / including the inputs; "
    "peak: measured / planned by the compiler, in the timed loop (the last step's results "
    "held until the next step returns: backplan's report.peak_bytes); backplan's "
    "compiled steps are measured by the checked mode (BACKPLAN_CHECK_MEMORY=1: every buffer "
    "its compiled plans allocate, counted, plus the arrays passed in), the NumPy peer's by "
    "tracemalloc (NumPy allocations); "
    "python -m backplan.bench.memory measures resident memory in a fresh process",
    "max rel err: against a float64 NumPy reference; check: ok, WRONG, error or skipped",
)


def ratio(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def model_title(record: dict, model: dict) -> str:
    title = f"{model['name']}: {model['summary']}"
    flops = next(
        (r.get("flops_per_step") for r in record["results"] if r["model"] == model["name"]),
        None,
    )
    if flops:
        title += f"; {flops / 1e6:.4g} MFLOP per step"
    if record["run"]["small"]:
        sizes = ", ".join(f"{k}={v}" for k, v in model["config"].items())
        title += f" [SHRUNK to {sizes}]"
    return title


def ms(value) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if value < 10 else f"{value:.1f}"


def seconds(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def mib(value) -> str:
    return "-" if value is None else f"{value / MIB:.2f}"


def pair(a: str, b: str) -> str:
    return "-" if a == b == "-" else f"{a} / {b}"


def row_cells(row: dict) -> list[str]:
    """The cells of one result row, in COLUMNS order."""
    step = row.get("step_ms") or {}
    first = row.get("first_call_s") or {}
    saved = row.get("saved_bytes") or {}
    peak = row.get("peak_bytes") or {}
    check = row.get("check") or {}
    to_fastest = row.get("ratio_to_fastest")
    error = (
        max(check.get("value_rel_error", 0.0), check.get("grad_rel_error", 0.0)) if check else None
    )
    return [
        row["peer"],
        ms(step.get("median")),
        ms(step.get("min")),
        ms(step.get("max")),
        "-" if to_fastest is None else f"{to_fastest:.2f}",
        rate_text(row.get("rate")),
        pair(seconds(first.get("cold")), seconds(first.get("warm"))),
        pair(mib(saved.get("excluding_inputs")), mib(saved.get("including_inputs"))),
        pair(mib(peak.get("measured")), mib(peak.get("planned"))),
        "-" if error is None else f"{error:.1e}",
        status_text(row),
    ]


def rate_text(rate: dict | None) -> str:
    """'212 (45%)': GFLOP/s, and the share of the measured peak when there is one."""
    if not rate:
        return "-"
    gflops = rate["gflops"]
    text = f"{gflops:.3g}" if gflops < 100 else f"{gflops:.0f}"
    share = rate.get("peak_fraction")
    return text if share is None else f"{text} ({100 * share:.0f}%)"


def limit_lines(record: dict) -> list[str]:
    """The limit the % of peak is taken against: per core, the cores used, the CPU."""
    limit = record.get("limit")
    if not limit:
        return []
    env = record["environment"]
    cpu = f"{env['cpu']} ({env.get('cpu_signature', '?')})"
    how = "measured in this run" if limit["measured"] == "now" else "measured once, cached"
    return [
        f"limit: {limit['flops_per_core']:.1f} f32 GFLOP/s per core of {limit['width']}-bit "
        f"FMAs on {cpu} ({how}), x {limit['threads']} thread(s) = {limit['gflops']:.1f} GFLOP/s"
    ]


def status_text(row: dict) -> str:
    status = row.get("status") or "-"
    if status == "wrong":
        return "WRONG (" + (row["check"].get("worst_grad") or "value") + ")"
    if status in ("error", "skipped"):
        return f"{status}: {row.get('note')}"
    return status


def footnotes(rows: list[dict], threads_set: bool = False) -> list[str]:
    """backplan's plan facts, warnings a peer gave on its first call, and notes on rows that ran
    (a measurement that failed); error and skip notes are in the check column already."""
    lines = []
    for row in rows:
        step = row.get("step_ms")
        if step and step["min"] > 0 and step["median"] / step["min"] > NOISY_SPREAD:
            advice = "" if threads_set else "; --threads 1 is steadier"
            lines.append(
                f"{row['peer']}: noisy, the median is {step['median'] / step['min']:.1f}x "
                "the fastest step (other work on the machine, or thread pools of "
                f"different libraries fighting{advice})"
            )
        plan = row.get("plan")
        if plan:
            lines.append(
                f"{row['peer']}: {plan['backend']} backend, {plan['kernels']} kernels "
                f"({plan['fused_kernels']} fused)"
            )
        peak = row.get("peak_bytes") or {}
        if peak.get("counted") is not None and peak["counted"] != peak["counted_predicted"]:
            lines.append(
                f"{row['peer']}: MEMORY MISMATCH, the checked mode counted {peak['counted']:,} B "
                f"of the step's own buffers at its peak, the plan predicts "
                f"{peak['counted_predicted']:,} B" + _held_words(peak)
            )
        first = row.get("first_call_s") or {}
        if first.get("import") is not None:
            lines.append(
                f"{row['peer']}: cold first call {first['cold']:.3f} s = import "
                f"{first['import']:.3f} s (torch.export, ATen mapping) + the first step"
            )
        for message in row.get("warnings") or []:
            lines.append(f"{row['peer']} warned: {message}")
        if row.get("note") and row.get("status") in ("ok", "wrong"):
            lines.append(f"{row['peer']}: {row['note']}")
    return lines


def threads_set(record: dict) -> bool:
    return bool(record["environment"]["threads"]["set_by_harness"])


def warm_lines(record: dict) -> list[str]:
    """What each peer's warm first call measured."""
    return [
        f"warm first call of {p['name']}: {p['warm_first_call']}"
        for p in record.get("peers", [])
        if p.get("warm_first_call")
    ]


def environment_lines(record: dict) -> list[str]:
    env = record["environment"]
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items())
    blas = "; ".join(_blas_text(lib) for lib in env["blas"]) or "unknown"
    variables = ", ".join(f"{k}={v}" for k, v in env["variables"].items()) or "none set"
    threads = env["threads"]
    set_by = (
        ", ".join(f"{k}: {v}" for k, v in threads["set_by_harness"].items())
        or "not set by the harness (library defaults)"
    )
    load = env.get("load_average_1min") or {}
    load_text = ""
    if load.get("start") is not None:
        load_text = f"; 1-min load average {load['start']:.1f} at start, {load['end']:.1f} at end"
    affinity = ""
    if env.get("affinity") is not None:
        affinity = f"; affinity CPUs {cpu_list_text(env['affinity'])}"
    return [
        f"CPU: {env['cpu']} ({env['usable_cpus']} usable of {env['logical_cpus']} logical CPUs"
        f"{affinity})" + load_text,
        f"Python {env['python']} on {env['platform']}",
        f"Versions: {versions}; backplan backend: {env.get('backplan_backend', '?')}, "
        f"revision {env.get('backplan_revision') or 'unknown'}",
        f"BLAS/OpenMP: {blas}",
        f"Environment: {variables}",
        f"Threads: {set_by}; in effect: {_in_effect(threads['in_effect'])}",
    ]


def _blas_text(lib: dict) -> str:
    parts = [lib.get("internal_api") or lib.get("user_api", "?"), lib.get("version") or ""]
    if lib.get("architecture"):
        parts.append(f"core {lib['architecture']}")
    if lib.get("num_threads") is not None:
        parts.append(f"{lib['num_threads']} threads")
    if lib.get("library"):
        parts.append(f"({lib['library']})")
    return " ".join(p for p in parts if p)


def _in_effect(counts: dict) -> str:
    parts = [f"{api} {n}" for api, n in counts.get("blas", {}).items()]
    if "torch" in counts:
        parts.append(f"torch {counts['torch']['intra_op']} intra-op")
    if "jax" in counts:
        flags = counts["jax"].get("xla_flags")
        parts.append(f"jax XLA_FLAGS={flags!r}" if flags else "jax default pool")
    if "numba" in counts:
        parts.append(f"numba {counts['numba']}")
    return ", ".join(parts)


def run_lines(record: dict) -> list[str]:
    """What kind of run this was: dtype, sizes, schedule."""
    run = record["run"]
    sizes = (
        "SHRUNK sizes (--small): not the documented configuration" if run["small"] else "full sizes"
    )
    schedule = run["schedule"]
    caches = run.get("caches") or {}
    if caches.get("cold_caches"):
        names = ", ".join(k for k in caches.get("variables", {}) if k != "note")
        cold = f"cold first calls with empty disk caches ({names} set to a new folder)"
    else:
        cold = "cold first calls with the compilers' disk caches as found"
    return [
        f"dtype {run['dtype']}, {sizes}, {schedule['rounds']} interleaved rounds after "
        f"{schedule['warmup_steps']} warm-up step(s)" + (" (--quick)" if run["quick"] else ""),
        cold,
    ]


def _held_words(peak: dict) -> str:
    """What a mismatched count held: its buffers at the peak, largest first, and the bytes the
    earlier steps left alive (arenas and kept outputs the measured step started with)."""
    held = peak.get("counted_held")
    if not held:
        return ""
    names = sorted(held.items(), key=lambda kv: -kv[1])
    shown = ", ".join(f"{name} {nbytes:,}" for name, nbytes in names[:8])
    more = f" and {len(names) - 8} more" if len(names) > 8 else ""
    left = peak.get("left_alive")
    left = f"; {left:,} B of it left alive by the earlier steps" if left is not None else ""
    return f" (held at the peak: {shown}{more}{left})"
