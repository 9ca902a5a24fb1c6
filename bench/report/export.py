"""The run record as JSON (every field) and CSV (one flat row per model and peer). Reading a
record back is plain JSON parsing: nothing is unpickled or executed.

The JSON record (schema "backplan-bench/1"):

- schema, command (the command line that reproduces the run), started, elapsed_s
- run: dtype, small (shapes shrunk), quick, schedule (warmup_steps, settle_steps, rounds,
  round_seconds, min_steps, max_steps), warm_compile, caches (cold_caches, variables)
- environment: cpu, logical_cpus, usable_cpus, load_average_1min {start, end}, platform,
  python, versions {library: version}, blas [{user_api, internal_api, version, num_threads,
  architecture (the OpenBLAS core type), library}], variables (OPENBLAS_CORETYPE and the
  thread variables that are set), threads {set_by_harness, in_effect}, backplan_backend,
  backplan_revision
- models: [{name, summary, train, config (the sizes run), static}]
- peers: [{name, description, warm_first_call}]; skipped_peers: [{peer, reason}]
- results: one per model and peer: model, peer, peer_description, status ("ok", "wrong",
  "error", "skipped"), note, step_ms {median, min, max, n}, ratio_to_fastest (median over the
  fastest correct peer's), first_call_s {cold, warm} (seconds), saved_bytes {excluding_inputs,
  including_inputs, source}, peak_bytes {measured, measured_by, planned, planned_by; backplan's
  compiled rows also counted, counted_predicted: the checked mode's own buffers against the
  plan's, equal when the plan holds what it predicts}, check
  {value_rel_error, grad_rel_error, worst_grad, tolerance, ok}, plan {backend, kernels,
  fused_kernels} (backplan rows), warnings (what the peer warned about on its first call),
  flops_per_step (the model's, bench/limits.py), rate {gflops, peak_fraction} (None untimed)
- limit: flops_per_core, width, threads, measured ("now" or "cached"), gflops: the measured FMA
  peak of the cores used, which peak_fraction divides by (None where it could not be measured)
"""

from __future__ import annotations

import csv
import json

from ..errors import BenchError

SCHEMA = "backplan-bench/1"

CSV_FIELDS = (
    "model",
    "peer",
    "status",
    "step_ms_median",
    "step_ms_min",
    "step_ms_max",
    "steps",
    "ratio_to_fastest",
    "gflops",
    "peak_fraction",
    "first_call_cold_s",
    "first_call_warm_s",
    "saved_bytes_excluding_inputs",
    "saved_bytes_including_inputs",
    "peak_bytes_measured",
    "peak_bytes_planned",
    "value_rel_error",
    "grad_rel_error",
    "check_ok",
    "note",
)


def write_json(record: dict, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2, sort_keys=False)
        f.write("\n")


def read_json(path: str, schema: str = SCHEMA) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise BenchError(f"cannot read benchmark results from {path}: {exc}") from None
    if not isinstance(record, dict) or record.get("schema") != schema:
        found = record.get("schema") if isinstance(record, dict) else type(record).__name__
        raise BenchError(
            f"{path} is not a backplan bench record (schema {found!r}, expected {schema!r})"
        )
    return record


def flat_row(row: dict) -> dict:
    step = row.get("step_ms") or {}
    first = row.get("first_call_s") or {}
    saved = row.get("saved_bytes") or {}
    peak = row.get("peak_bytes") or {}
    check = row.get("check") or {}
    rate = row.get("rate") or {}
    return {
        "model": row["model"],
        "peer": row["peer"],
        "status": row["status"],
        "step_ms_median": step.get("median"),
        "step_ms_min": step.get("min"),
        "step_ms_max": step.get("max"),
        "steps": step.get("n"),
        "ratio_to_fastest": row.get("ratio_to_fastest"),
        "gflops": rate.get("gflops"),
        "peak_fraction": rate.get("peak_fraction"),
        "first_call_cold_s": first.get("cold"),
        "first_call_warm_s": first.get("warm"),
        "saved_bytes_excluding_inputs": saved.get("excluding_inputs"),
        "saved_bytes_including_inputs": saved.get("including_inputs"),
        "peak_bytes_measured": peak.get("measured"),
        "peak_bytes_planned": peak.get("planned"),
        "value_rel_error": check.get("value_rel_error"),
        "grad_rel_error": check.get("grad_rel_error"),
        "check_ok": check.get("ok"),
        "note": row.get("note"),
    }


def write_csv(record: dict, path: str) -> None:
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for row in record["results"]:
            writer.writerow(flat_row(row))
