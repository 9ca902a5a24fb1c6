"""The imported PyTorch models in the harness: `python -m backplan bench` runs each model's torch
module imported with bp.from_torch beside torch eager (and torch.compile when named), checks it
against the float64 reference, and summarises import + first call; bench.torch_import's table
agrees with torch eager. Times are printed, never asserted."""

import argparse
import io
import json

import pytest

pytest.importorskip("torch", reason="needs PyTorch: pip install 'backplan[torch]'")

from backplan.bench import cli, torch_import  # noqa: E402
from backplan.bench.peers import select_peers  # noqa: E402
from backplan.bench.report.imported import HEADER, TITLE  # noqa: E402
from backplan.bench.report.markdown import render_markdown  # noqa: E402


def run_cli(*argv: str) -> tuple[int, str]:
    """`python -m backplan bench ARGV` in this process: (exit code, the printed report)."""
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    out = io.StringIO()
    return cli.run(parser.parse_args(["--quiet", *argv]), out=out), out.getvalue()


def test_the_bench_cli_times_the_imported_model_beside_torch_eager(tmp_path):
    path = tmp_path / "run.json"
    code, text = run_cli(
        "--quick",
        "--small",
        "--models",
        "mlp_tiny",
        "--against",
        "torch.eager,backplan.from_torch",  # --quick runs the imported row when named
        "--json",
        str(path),
    )
    record = json.loads(path.read_text())
    rows = {r["peer"]: r for r in record["results"]}
    assert code == 0, rows
    imported = rows["backplan.from_torch"]
    assert imported["status"] == "ok" and imported["check"]["ok"]
    assert imported["step_ms"]["median"] > 0 and rows["torch"]["step_ms"]["median"] > 0
    first = imported["first_call_s"]
    assert 0 < first["import"] <= first["cold"]  # the cold first call includes the import
    assert "torch.compile" not in rows  # --quick leaves it out unless --against names it
    summary = text.split(f"{TITLE}:\n", 1)[1].splitlines()
    assert summary[0].split() == " ".join(HEADER).split()
    cells = summary[1].split()
    assert cells[0] == "mlp_tiny"
    assert float(cells[1]) > 0 and float(cells[2]) > 0 and float(cells[4].rstrip("x")) > 0
    assert float(cells[6]) == pytest.approx(first["cold"], abs=1e-3) and cells[7] == "-"
    markdown = "\n".join(render_markdown(record))  # --markdown BENCHMARKS.md: the same table
    assert f"### {TITLE}" in markdown
    assert f"| mlp_tiny | {cells[1]} | {cells[2]} | - | {cells[4]} |" in markdown


def test_the_imported_row_comes_with_any_torch_peer_and_only_then():
    def names(*against):
        return [peer.name for peer in select_peers(list(against))]

    assert names("torch") == [
        "backplan",
        "backplan.compile",
        "backplan.from_torch",
        "torch",
        "torch.compile",
    ]
    assert "backplan.from_torch" in names("numpy", "torch.compile")
    assert "backplan.from_torch" not in names("numpy", "jax")
    assert names("backplan.from_torch") == ["backplan", "backplan.compile", "backplan.from_torch"]


def test_quick_runs_the_imported_row_only_when_named():
    def names(*against):
        return [peer.name for peer in select_peers(list(against), imported_with_torch=False)]

    assert "backplan.from_torch" not in names("numpy", "torch.eager", "jax")
    assert "backplan.from_torch" in names("torch.eager", "backplan.from_torch")


def test_imported_cnn_matches_torch_eager_in_the_table(capsys):
    torch_import.main(
        ["--small", "--rounds", "1", "--seconds", "0.01", "--no-torch-compile", "--models", "cnn"]
    )
    header, rule, row = capsys.readouterr().out.strip().splitlines()
    assert header.startswith("| model | backplan (imported) ms | torch eager ms |")
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == "cnn" and float(cells[3]) < 1e-5  # losses and gradients agree
    assert "backplan import" in cells[4]
