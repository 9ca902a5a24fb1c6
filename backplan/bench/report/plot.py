"""--plot: one bar chart per model of median step time by peer (matplotlib, optional)."""

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
        rows = [r for r in record["results"]
                if r["model"] == model["name"] and r["step_ms"] is not None]
        names = [r["peer"] + ("" if r["status"] == "ok" else f" ({r['status']})") for r in rows]
        medians = [r["step_ms"]["median"] for r in rows]
        colors = ["tab:orange" if r["peer"].startswith("backplan") else "tab:blue" for r in rows]
        ax.barh(names, medians, color=colors)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_title(f"{model['name']}: median step (ms, log scale)", fontsize=9, loc="left")
        for y, (value, row) in enumerate(zip(medians, rows, strict=True)):
            ax.text(value, y, f" {value:.3g} ms ({ratio(row['ratio_to_fastest'])})",
                    va="center", fontsize=8)
        ax.tick_params(labelsize=8)
    fig.suptitle(f"backplan bench, {record['run']['dtype']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
