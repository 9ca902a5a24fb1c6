"""`bench compile` and the unrolled LSTM models: the command's record has the fields the table
needs, peers that are not installed are skipped with a note, the LSTM's gradients agree with the
hand-written reference and with finite differences. No timing is asserted."""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os

import numpy as np
import pytest

import backplan as bp
from backplan.bench import cli
from backplan.bench.compile_child import driver_hooks
from backplan.bench.compile_time import cache_environment, summarise
from backplan.bench.models import MODELS
from backplan.bench.models.lstm import loss as lstm_loss
from backplan.bench.peers.jax_peer import JaxPeer
from backplan.bench.peers.numpy_peer import run_numpy
from backplan.bench.peers.torch_peer import TorchPeer
from backplan.bench.report import compile_table
from backplan.bench.report.markdown import BEGIN, END


def run_cli(*argv: str) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    out = io.StringIO()
    return cli.run(parser.parse_args(["--quiet", *argv]), out=out), out.getvalue()


@pytest.fixture(scope="module")
def compile_record(tmp_path_factory):
    """One round of mlp_tiny at shrunk sizes through backplan (two fresh processes), with
    torch and jax made to look absent so the run needs neither."""
    folder = tmp_path_factory.mktemp("compile")
    json_path, md_path = folder / "run.json", folder / "BENCHMARKS.md"
    md_path.write_text(f"# Benchmarks\n\n{BEGIN}\nstep table\n{END}\n\nNotes.\n")
    original = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TorchPeer, "missing", lambda self: "torch is not installed")
        patch.setattr(JaxPeer, "missing", lambda self: "jax is not installed")
        code, text = run_cli(
            "compile",
            "--small",
            "--models",
            "mlp_tiny",
            "--rounds",
            "1",
            "--threads",
            "1",
            "--json",
            str(json_path),
            "--markdown",
            str(md_path),
        )
    if original is not None:  # --threads 1 pinned every thread of this process
        for name in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(name), original)
            except ProcessLookupError:
                pass
    return code, text, json.loads(json_path.read_text()), md_path.read_text()


def test_compile_rows_for_backplan_have_cold_and_warm_times(compile_record):
    code, _, record, _ = compile_record
    assert code == 0
    assert record["schema"] == "backplan-bench-compile/1"
    row = next(r for r in record["results"] if r["peer"] == "backplan")
    assert row["status"] == "ok", row["note"]
    assert row["check_ok"] and row["max_rel_error"] < 1e-3
    for process in ("cold", "warm"):
        for field in ("import_s", "first_call_s", "second_call_s"):
            assert row[process][field] > 0, (process, field)
    assert row["cold"]["fast_after_s"] is None or row["cold"]["fast_after_s"] > 0
    assert row["cold"]["resized_first_call_s"] > 0  # the same model at the other sizes
    assert record["run"]["child_variables"]["NUMBA_NUM_THREADS"] == "1"
    assert record["environment"]["cpu"] and record["environment"]["load_average_1min"]["start"]


def test_absent_peers_are_skipped_with_a_note(compile_record):
    _, text, record, _ = compile_record
    assert record["skipped_peers"] == [
        {"peer": "torch.compile", "reason": "torch is not installed"},
        {"peer": "jax", "reason": "jax is not installed"},
    ]
    skipped = {r["peer"]: r for r in record["results"] if r["status"] == "skipped"}
    assert skipped["jax"]["note"] == "jax is not installed"
    assert "Skipped jax: jax is not installed" in text


def test_compile_table_has_its_own_part_of_the_markdown(compile_record):
    _, _, record, content = compile_record
    assert "step table" in content and "Notes." in content
    assert content.count(compile_table.BEGIN) == 1 and content.count(compile_table.END) == 1
    assert compile_table.HEADING in content
    assert record["command"] in content
    assert record["command"].startswith("python -m backplan bench compile --models mlp_tiny")
    assert "| mlp_tiny | backplan |" in content


def test_a_saved_compile_record_is_reported_again(compile_record, tmp_path):
    _, text, record, _ = compile_record
    path = tmp_path / "compile.json"
    path.write_text(json.dumps(record))
    code, again = run_cli("compile", "--from-json", str(path))
    assert code == 0 and again == text
    step_record = tmp_path / "step.json"
    step_record.write_text('{"schema": "backplan-bench/1"}')
    assert run_cli("compile", "--from-json", str(step_record))[0] == 2


def test_step_time_options_are_refused_by_compile(capsys):
    assert run_cli("compile", "--quick", "--models", "mlp_tiny")[0] == 2
    assert "--quick" in capsys.readouterr().err
    assert run_cli("compile", "--against", "tensorflow")[0] == 2
    assert run_cli("compile", "--rounds", "0", "--against", "none")[0] == 2


def test_children_get_empty_caches_and_no_jax_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/somewhere")
    env = cache_environment(str(tmp_path), threads=1)
    assert env["BACKPLAN_CACHE_DIR"].startswith(str(tmp_path))
    assert env["TORCHINDUCTOR_CACHE_DIR"].startswith(str(tmp_path))
    assert env["JAX_ENABLE_COMPILATION_CACHE"] == "false"
    assert "JAX_COMPILATION_CACHE_DIR" not in env
    assert env["XLA_FLAGS"] == "--xla_cpu_multi_thread_eigen=false"


def test_medians_over_rounds_and_a_failed_round_is_noted():
    def child(first, tier=None):
        check = {"ok": True, "value_rel_error": 1e-7, "grad_rel_error": 2e-7}
        times = {"import_s": 1.0, "first_call_s": first, "second_call_s": 0.01}
        return {**times, "load_average_1min": 1.5, "check": check, "driver_tier": tier}

    runs = [(child(3.0), child(0.5)), (child(5.0), child(0.3)), (child(4.0), child(0.4))]
    runs.append(({"error": "exit 1: boom"}, {"error": "cold run failed"}))
    row = summarise("mlp", "backplan", runs)
    assert row["status"] == "ok" and row["completed_rounds"] == 3
    assert row["cold"]["first_call_s"] == 4.0 and row["warm"]["first_call_s"] == 0.4
    assert row["cold"]["fast_after_s"] is None and row["note"] == "exit 1: boom"
    assert summarise("mlp", "jax", runs[-1:])["status"] == "error"


def test_driver_hooks_wait_for_backplans_background_builds_only():
    from backplan.codegen.build import driver_builder

    wait, state = driver_hooks("backplan")
    assert wait is driver_builder.wait_for_builds and wait(timeout=60)
    assert state in ("building", "compiled") and driver_hooks("backplan")[1] == "compiled"
    assert driver_hooks("jax") == (None, None)


@pytest.mark.parametrize("name", ["lstm12", "lstm48"])
def test_lstm_traces_and_matches_the_reference(name):
    """Traced by bp.value_and_grad and run on the NumPy reference interpreter, in float64: the
    loss and gradients equal the hand-written backward through time, and a central difference
    of the traced loss along a random direction."""
    from backplan.runtime.backend import use_backend

    spec = MODELS[name]
    inputs = spec.inputs(small=True, dtype=np.float64, seed=5)
    params = {k: bp.tensor(v) for k, v in inputs.params.items()}
    batch = [bp.tensor(a) for a in inputs.batch(True)]
    with use_backend("reference"):
        step_fn = bp.value_and_grad(lstm_loss)
        value, grads = step_fn(params, *batch)
        expected_value, expected_grads, _ = run_numpy(spec, inputs)
        assert float(value.numpy()) == pytest.approx(float(expected_value), rel=1e-12)
        for key, grad in grads.items():
            np.testing.assert_allclose(grad.numpy(), expected_grads[key], rtol=1e-10, atol=1e-12)
        rng = np.random.default_rng(11)
        direction = {k: rng.standard_normal(v.shape) for k, v in inputs.params.items()}
        step = 1e-6

        def traced_loss(sign):
            moved = {k: bp.tensor(v + sign * step * direction[k]) for k, v in inputs.params.items()}
            return float(step_fn(moved, *batch)[0].numpy())

        numeric = (traced_loss(1.0) - traced_loss(-1.0)) / (2 * step)
    analytic = sum(float(np.sum(grads[k].numpy() * direction[k])) for k in grads)
    assert analytic == pytest.approx(numeric, rel=1e-6, abs=1e-9)


def test_lstm_peers_agree_with_the_reference(tmp_path):
    """The unrolled LSTM through PyTorch eager and JAX, where installed, in the step run."""
    installed = {"torch": "torch.eager", "jax": "jax"}
    against = [peer for module, peer in installed.items() if importlib.util.find_spec(module)]
    if not against:
        pytest.skip("neither torch nor jax is installed")
    path = tmp_path / "lstm.json"
    code, _ = run_cli(
        "--quick",
        "--small",
        "--models",
        "lstm12",
        "--against",
        ",".join(against),
        "--json",
        str(path),
    )
    record = json.loads(path.read_text())
    rows = {r["peer"]: r for r in record["results"]}
    assert code == 0, [(r["peer"], r["status"], r["note"]) for r in rows.values()]
    assert all(r["status"] == "ok" for r in rows.values())
    assert {"torch" if p == "torch.eager" else p for p in against} <= set(rows)


def test_a_stopped_run_says_how_many_rounds_it_finished(compile_record):
    _, _, record, _ = compile_record
    partial = {**record, "run": {**record["run"], "rounds": 3, "rounds_done": 1}}
    assert "1 of 3 rounds done" in "\n".join(compile_table.render_lines(partial))


def test_the_background_cell_checks_out_and_ends_on_compiled_plans(tmp_path, monkeypatch):
    """backplan.background (`--against backplan.background`): value_and_grad(background=True)
    in the child's own measure: checked against the float64 reference, and compiled once the
    child has waited for its builds."""
    from backplan.bench.compile_child import measure
    from backplan.runtime.backend import use_backend

    monkeypatch.setenv("BACKPLAN_CACHE_DIR", str(tmp_path / "kernels"))
    request = {"model": "mlp_tiny", "peer": "backplan.background", "small": True}
    with use_backend("numba"):
        result = measure({**request, "dtype": "float32"})
    assert result["check"]["ok"], result["check"]
    assert result["driver_tier_ready"] == "compiled" and result["fast_after_s"] > 0


def test_a_background_row_brings_its_legend_line(compile_record):
    _, text, record, _ = compile_record
    assert compile_table.BACKGROUND_LEGEND not in text
    row = next(r for r in record["results"] if r["peer"] == "backplan")
    with_cell = {**record, "results": [*record["results"], {**row, "peer": "backplan.background"}]}
    lines = compile_table.render_lines(with_cell)
    assert f"- {compile_table.BACKGROUND_LEGEND}" in lines
    assert any(line.startswith("| mlp_tiny | backplan.background |") for line in lines)
