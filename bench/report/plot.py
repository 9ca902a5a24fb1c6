"""--plot: one bar chart per model of each peer's median step time as a multiple of the fastest
correct peer's (linear, from 0), labelled with the time itself (matplotlib, optional)."""

from __future__ import annotations

import importlib.util

from ..errors import BenchError
from .format import ratio


def write_plot(record: dict, path: str) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise BenchError("--plot needs matplotlib: pip install 'backplan[plot]'")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = record["models"]
    fig, axes = plt.subplots(len(models), 1, figsize=(8, 1.2 + 1.6 * len(models)), squeeze=False)
    for ax, model in zip(axes[:, 0], models, strict=True):
        rows = [
            r
            for r in record["results"]
            if r["model"] == model["name"] and r["ratio_to_fastest"] is not None
        ]
        names = [r["peer"] + ("" if r["status"] == "ok" else f" ({r['status']})") for r in rows]
        ratios = [r["ratio_to_fastest"] for r in rows]
        colors = ["tab:orange" if r["peer"].startswith("backplan") else "tab:blue" for r in rows]
        ax.barh(names, ratios, color=colors)
        ax.invert_yaxis()
        ax.set_xlim(0, max(ratios, default=1.0) * 1.35)
        ax.set_title(f"{model['name']}: median step, x fastest", fontsize=9, loc="left")
        for y, (value, row) in enumerate(zip(ratios, rows, strict=True)):
            ax.text(
                value,
                y,
                f" {ratio(value)} ({row['step_ms']['median']:.3g} ms)",
                va="center",
                fontsize=8,
            )
        ax.tick_params(labelsize=8)
    fig.suptitle(f"backplan bench, {record['run']['dtype']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
