"""The figures the README and docs/ print are the ones the code prints now, on the numba backend
they name. tests/test_docs.py runs every block on the reference interpreter (the printed numbers
are numba's, so it cannot compare them) and test_explain.py checks the explain example; here the
memory-budget and update-order text blocks are recomputed with explain and memory_frontier,
which plan without compiling anything."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import numba
import numpy as np
import pytest

import backplan as bp
from backplan.runtime.backend import use_backend

ROOT = Path(__file__).resolve().parent.parent
README = "README.md"


def text_block_after(page: str, marker: str) -> str:
    """The first ```text block of the page after the line containing marker."""
    text = (ROOT / page).read_text()
    after = text[text.index(marker) :]
    return after.split("```text\n", 1)[1].split("\n```", 1)[0]


def python_blocks_between(page: str, start: str, end: str) -> list[tuple[int, str]]:
    """The ```python blocks of the page between two headings, with their first line."""
    lines = (ROOT / page).read_text().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(start))
    last = next(i for i in range(first + 1, len(lines)) if lines[i].startswith(end))
    blocks, i = [], first
    while i < last:
        if lines[i].strip() == "```python":
            stop = next(j for j in range(i + 1, last) if lines[j].strip() == "```")
            blocks.append((i + 2, "\n".join(lines[i + 1 : stop])))
            i = stop
        i += 1
    return blocks


@pytest.fixture
def one_thread(monkeypatch):
    """The figures are one thread's: BLAS's threads decide whether a product is shared out on
    backplan's GEMM, whose packing pages the peak counts (codegen/kernels/gemm/packing.py)."""
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    previous = numba.get_num_threads()
    numba.set_num_threads(1)
    yield
    numba.set_num_threads(previous)


def flat(text: str) -> str:
    return " ".join(text.split())


def test_the_readme_budget_example_prints_what_its_text_shows(tmp_path, monkeypatch, one_thread):
    """README's explain and budget blocks, run on numba as written (nothing runs the model:
    explain, memory_frontier and a refusal plan only); the refusal printed is the one shown
    (its '...' elides whole sentences)."""
    monkeypatch.chdir(tmp_path)
    namespace = {"np": np, "bp": bp}
    out = io.StringIO()
    with use_backend("numba"), contextlib.redirect_stdout(out):
        for line, code in python_blocks_between(README, "## Explain in one screen", "## From"):
            exec(compile("\n" * (line - 1) + code, "README.md", "exec"), namespace)
    frontier, met = namespace["frontier"], namespace["met"]
    with use_backend("numba"):
        chosen = met.explain(namespace["deep"], namespace["xb"]).peak_bytes
    plans = re.search(r"# (\d+) plans on numba", (ROOT / README).read_text()).group(1)
    assert len(frontier.points) == int(plans)
    runs = re.search(r"# runs the \+([\d.]+)% plan", (ROOT / README).read_text()).group(1)
    point = next(p for p in frontier.points if p.peak_bytes == chosen)
    assert f"{100 * point.added_flops / frontier.step_flops:.1f}" == runs
    shown = flat(text_block_after(README, "except bp.MemoryBudgetError as refused:"))
    printed = flat(out.getvalue().split("deep_loss: no plan fits", 1)[1]).strip()
    pieces = [p.strip() for p in shown.split("deep_loss: no plan fits", 1)[1].split(" ... ")]
    assert printed.startswith(pieces[0]) and printed.endswith(pieces[-1]), printed
    for piece in pieces:
        assert piece in printed, piece


def deep_loss(params, x):
    for w in params.values():
        x = bp.tanh(x @ w)
    return bp.mean(x * x)


def explain_page_arrays():
    """docs/explain.md's memory-budget arrays (the page's own rng sequence)."""
    rng = np.random.default_rng(0)
    deep = {f"w{i}": rng.standard_normal((64, 64)).astype(np.float32) * 0.2 for i in range(6)}
    xb = rng.standard_normal((256, 64)).astype(np.float32)
    return deep, xb


def test_the_explain_page_budget_figures_are_numbas(one_thread):
    page = "docs/explain.md"
    source = (ROOT / page).read_text()
    assert "for i in range(6)}\nxb = rng.standard_normal((256, 64))" in source  # as recreated
    deep, xb = explain_page_arrays()
    with use_backend("numba"):
        frontier = bp.value_and_grad(deep_loss).memory_frontier(deep, xb)
        assert str(frontier).rstrip("\n") == text_block_after(page, "print(frontier)\nbudget")
        budget = frontier.points[0].peak_bytes - 1
        narrow = bp.value_and_grad(
            deep_loss, max_peak_bytes=budget, allow_saved_dtype=bp.bfloat16
        ).explain(deep, xb)
        assert narrow.saved_dtype_note == text_block_after(page, "print(report.saved_dtype_note)")
        rows = bp.value_and_grad(deep_loss, allow_saved_dtype=bp.bfloat16).memory_frontier(deep, xb)
        assert str(rows).rstrip("\n") == text_block_after(page, "print(rows)")
        default = frontier.points[0].peak_bytes
        assert f"({narrow.peak_bytes // 1024} KiB against {default // 1024} KiB" in source

        opt = bp.optim.adam(1e-3)

        def train_step(budget=None):
            @bp.compile(donate_argnums=(0, 1), max_peak_bytes=budget)
            def step(params, state, x):
                loss, grads = bp.value_and_grad(deep_loss)(params, x)
                params, state = opt.update(grads, state, params)
                return params, state, loss

            return step

        params = {k: bp.tensor(w) for k, w in deep.items()}
        state = opt.init(params)
        points = train_step().memory_frontier(params, state, xb).points
        smallest = train_step(points[-1].peak_bytes).explain(params, state, xb)
        shown = text_block_after(page, "print(step.explain(params, state, xb).saved_dtype_note)")
        assert smallest.saved_dtype_note == shown
        figures = f"(numba: {points[0].peak_bytes:,} B by default, {points[-1].peak_bytes:,} B"
        assert figures in source


def test_the_update_order_sentence_of_the_optimizers_page():
    """docs/optimizers.md's sentence, for the model it describes: four 64-wide layers with
    biases, tanh between them, adam on mse_loss, x and y f32[8,64]."""
    page = "docs/optimizers.md"
    assert "4-layer, 64-wide MLP with biases" in (ROOT / page).read_text()
    rng = np.random.default_rng(0)
    params = {}
    for i in range(4):
        params[f"w{i}"] = bp.tensor(rng.standard_normal((64, 64)).astype(np.float32) * 0.1)
        params[f"b{i}"] = bp.tensor(np.zeros(64, np.float32))
    x = rng.standard_normal((8, 64)).astype(np.float32)
    y = rng.standard_normal((8, 64)).astype(np.float32)

    def loss_fn(params, x, y):
        for i in range(4):
            x = x @ params[f"w{i}"] + params[f"b{i}"]
            x = bp.tanh(x) if i < 3 else x
        return bp.mse_loss(x, y)

    adam = bp.optim.adam(0.1)

    @bp.compile(donate_argnums=(0, 1))
    def adam_step(params, state, x, y):
        loss, grads = bp.value_and_grad(loss_fn)(params, x, y)
        params, state = adam.update(grads, state, params)
        return params, state, loss

    with use_backend("numba"):
        summary = flat(str(adam_step.explain(params, adam.init(params), x, y)))
    shown = text_block_after(page, "explain's summary says which order runs")
    assert shown in summary, shown
