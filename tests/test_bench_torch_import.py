"""bench.torch_import: the imported bench model steps to torch eager's loss and gradients, and
the table has a row per model (times are printed, never asserted)."""

import pytest

pytest.importorskip("torch", reason="needs PyTorch: pip install 'backplan[torch]'")

from backplan.bench import torch_import  # noqa: E402


def test_imported_cnn_matches_torch_eager_in_the_table(capsys):
    torch_import.main(
        ["--small", "--rounds", "1", "--seconds", "0.01", "--no-torch-compile", "--models", "cnn"]
    )
    header, rule, row = capsys.readouterr().out.strip().splitlines()
    assert header.startswith("| model | backplan (imported) ms | torch eager ms |")
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == "cnn" and float(cells[3]) < 1e-5  # losses and gradients agree
    assert "backplan import" in cells[4]
