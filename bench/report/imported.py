"""The imported PyTorch models at a glance: per model, the step of the module imported with
bp.from_torch beside the same model under PyTorch eager and torch.compile (same process, same
threads), and the import + first call beside torch.compile's first call. Built from the rows
the per-model tables show; empty when the run had no backplan.from_torch row."""

from __future__ import annotations

from .format import ms, seconds

IMPORTED = "backplan.from_torch"
HEADER = (
    "model",
    "imported ms",
    "torch eager ms",
    "torch.compile ms",
    "imported / eager",
    "imported / compile",
    "import + 1st call s",
    "torch.compile 1st call s",
)


def imported_rows(record: dict) -> list[list[str]]:
    """One row of HEADER cells per model the imported peer ran (skipped ones left out)."""
    rows = []
    for model in record["models"]:
        by_peer = {r["peer"]: r for r in record["results"] if r["model"] == model["name"]}
        imported = by_peer.get(IMPORTED)
        if imported is None or imported["step_ms"] is None:
            continue
        eager, compiled = by_peer.get("torch"), by_peer.get("torch.compile")
        rows.append(
            [
                model["name"],
                _median(imported),
                _median(eager),
                _median(compiled),
                _ratio(imported, eager),
                _ratio(imported, compiled),
                seconds(_first(imported)),
                seconds(_first(compiled)),
            ]
        )
    return rows


def _median(row: dict | None) -> str:
    step = (row or {}).get("step_ms")
    return ms(step["median"]) if step else "-"


def _ratio(row: dict, peer: dict | None) -> str:
    step = (peer or {}).get("step_ms")
    if not step or (peer or {}).get("status") != "ok":
        return "-"
    # three significant digits: a torch step slowed by load gave 0.454 / 117.7 ms as "0.00x"
    return f"{row['step_ms']['median'] / step['median']:.3g}x"


def _first(row: dict | None) -> float | None:
    return ((row or {}).get("first_call_s") or {}).get("cold")


TITLE = "Imported PyTorch models (bp.from_torch) beside the same model in PyTorch"
