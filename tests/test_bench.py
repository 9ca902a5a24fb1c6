"""The benchmark harness: quick runs at shrunk sizes check every model's gradients against the
float64 NumPy reference, which is itself checked against central finite differences. No timing
is asserted."""

from __future__ import annotations

import argparse
import csv
import importlib.util
import io
import json
import os

import numpy as np
import pytest

import backplan as bp
from backplan.bench import cli, suite
from backplan.bench.errors import BenchError
from backplan.bench.measure import QUICK
from backplan.bench.models import MODELS, select_models
from backplan.bench.peers import select_peers
from backplan.bench.peers.numpy_peer import NumpyPeer, NumpyRunner, run_numpy
from backplan.bench.progress import Progress
from backplan.bench.report.export import CSV_FIELDS
from backplan.bench.report.markdown import BEGIN, END
from backplan.bench.suite import Settings, bench_model

TRAIN_MODELS = [name for name, spec in MODELS.items() if spec.train]
QUICK_SMALL = Settings(small=True, schedule=QUICK, warm_compile=False)


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(["--quiet", *argv])


def run_cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return cli.run(bench_args(*argv), out=out), out.getvalue()


@pytest.fixture(scope="module")
def quick_record(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench")
    json_path, csv_path = folder / "run.json", folder / "run.csv"
    code, text = run_cli(
        "--quick",
        "--small",
        "--against",
        "numpy,backplan.reference",
        "--json",
        str(json_path),
        "--csv",
        str(csv_path),
    )
    return code, text, json.loads(json_path.read_text()), csv_path


def test_quick_run_checks_every_model_against_the_reference(quick_record):
    code, _, record, _ = quick_record
    assert code == 0
    assert [m["name"] for m in record["models"]] == list(MODELS)
    for spec in MODELS.values():
        rows = {r["peer"]: r for r in record["results"] if r["model"] == spec.name}
        assert set(rows) == {"backplan", "backplan.compile", "backplan.reference", "numpy"}
        checked = ["backplan", "backplan.reference", "numpy"]
        checked += ["backplan.compile"] if spec.train else []
        for peer in checked:
            check = rows[peer]["check"]
            assert rows[peer]["status"] == "ok", (spec.name, peer, rows[peer]["note"])
            assert check["ok"] and check["grad_rel_error"] <= check["tolerance"]
            assert check["value_rel_error"] <= check["tolerance"]
            assert rows[peer]["step_ms"]["n"] == QUICK.rounds * QUICK.max_steps
        if not spec.train:
            assert rows["backplan.compile"]["status"] == "skipped"


def test_quick_times_backplan_without_waiting_for_its_compiled_drivers(quick_record):
    """A quick run from empty caches spent minutes waiting for LSTM drivers to build."""
    _, text, record, _ = quick_record
    rows = [r for r in record["results"] if r["peer"] == "backplan" and r["status"] == "ok"]
    assert rows and all("driver_build_wait_s" not in r for r in rows)
    assert all(r["note"].startswith("--quick: steps timed without waiting") for r in rows)
    assert "--quick: steps timed without waiting" in text


def test_quick_runs_drivers_as_python_and_builds_none(monkeypatch, tmp_path):
    """Background driver builds in a quick run were never waited for, took the cores from the
    peers compiling after them and were stopped at exit: --quick starts none, and says so."""
    from backplan.codegen.build import driver_builder
    from backplan.runtime.backend import use_backend

    builds = []
    monkeypatch.setattr(driver_builder, "submit", builds.append)
    monkeypatch.delenv("BACKPLAN_DRIVER", raising=False)
    path = tmp_path / "run.json"
    with use_backend("numba"):  # the suite's default is the reference interpreter: no drivers
        code, _ = run_cli(
            "--quick", "--small", "--models", "mlp_tiny", "--against", "none", "--json", str(path)
        )
    assert code == 0
    rows = json.loads(path.read_text())["results"]
    assert {r["peer"] for r in rows} == {"backplan", "backplan.compile"}
    assert all(r["status"] == "ok" and r["check"]["ok"] for r in rows)
    assert all(r["note"] == suite.QUICK_PYTHON_DRIVER_NOTE for r in rows)
    assert builds == []  # mlp_tiny's step is worth a compiled driver: background would build it
    assert "BACKPLAN_DRIVER" not in os.environ


@pytest.mark.parametrize("chosen", [None, "background", "inline"])
def test_quick_leaves_a_driver_mode_the_environment_picks(monkeypatch, chosen):
    if chosen is None:
        monkeypatch.delenv("BACKPLAN_DRIVER", raising=False)
    else:
        monkeypatch.setenv("BACKPLAN_DRIVER", chosen)
    with cli._quick_drivers(quick=False):
        assert os.environ.get("BACKPLAN_DRIVER") == chosen
        assert suite._quick_driver_note() == suite.QUICK_DRIVER_NOTE
    with cli._quick_drivers(quick=True):
        assert os.environ.get("BACKPLAN_DRIVER") == (chosen or "python")
        expected = suite.QUICK_DRIVER_NOTE if chosen else suite.QUICK_PYTHON_DRIVER_NOTE
        assert suite._quick_driver_note() == expected
    assert os.environ.get("BACKPLAN_DRIVER") == chosen


def test_json_record_has_the_documented_fields(quick_record):
    _, _, record, _ = quick_record
    assert record["schema"] == "backplan-bench/1"
    assert record["command"].startswith("python -m backplan bench")
    assert {"quick", "small", "dtype", "schedule"} <= set(record["run"])
    assert record["run"]["small"] is True
    env = record["environment"]
    assert {"cpu", "usable_cpus", "versions", "blas", "variables", "threads"} <= set(env)
    assert "OPENBLAS_CORETYPE" in env["variables"]
    assert env["versions"]["numpy"] == np.__version__
    assert env["versions"]["backplan"] == bp.__version__
    row = next(r for r in record["results"] if r["peer"] == "backplan.compile")
    assert {
        "model",
        "peer",
        "status",
        "step_ms",
        "ratio_to_fastest",
        "first_call_s",
        "saved_bytes",
        "peak_bytes",
        "check",
        "note",
    } <= set(row)
    assert {"median", "min", "max", "n"} == set(row["step_ms"])
    assert row["step_ms"]["min"] <= row["step_ms"]["median"] <= row["step_ms"]["max"]
    assert {"excluding_inputs", "including_inputs"} <= set(row["saved_bytes"])
    assert row["saved_bytes"]["excluding_inputs"] <= row["saved_bytes"]["including_inputs"]
    assert row["peak_bytes"]["planned"] > 0


def test_ratios_are_against_the_fastest_peer_of_each_model(quick_record):
    _, _, record, _ = quick_record
    for model in record["models"]:
        rows = [
            r for r in record["results"] if r["model"] == model["name"] and r["step_ms"] is not None
        ]
        fastest = min(r["step_ms"]["median"] for r in rows)
        for row in rows:
            assert row["ratio_to_fastest"] == pytest.approx(row["step_ms"]["median"] / fastest)
        assert min(r["ratio_to_fastest"] for r in rows) == pytest.approx(1.0)


def test_csv_has_one_row_per_model_and_peer(quick_record):
    _, _, record, csv_path = quick_record
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == CSV_FIELDS
    assert len(rows) == len(record["results"])
    assert {(r["model"], r["peer"]) for r in rows} == {
        (r["model"], r["peer"]) for r in record["results"]
    }


def test_text_table_names_every_model_and_says_sizes_are_shrunk(quick_record):
    _, text, _, _ = quick_record
    assert "SHRUNK" in text
    for name in MODELS:
        assert f"\n{name}: " in text
    assert "OPENBLAS_CORETYPE" in text or "Environment: none set" in text


@pytest.mark.parametrize("name", TRAIN_MODELS)
def test_float64_reference_matches_central_differences(name):
    spec = MODELS[name]
    inputs = spec.inputs(small=True, dtype=np.float64, seed=3)
    _, grads, _ = run_numpy(spec, inputs)
    rng = np.random.default_rng(7)
    direction = {k: rng.standard_normal(v.shape) for k, v in inputs.params.items()}
    step = 1e-6

    def loss_at(sign):
        moved = {k: v + sign * step * direction[k] for k, v in inputs.params.items()}
        shifted = type(inputs)(moved, inputs.inputs, inputs.targets)
        return run_numpy(spec, shifted)[0]

    numeric = (loss_at(1.0) - loss_at(-1.0)) / (2 * step)
    analytic = sum(float(np.sum(grads[k] * direction[k])) for k in grads)
    assert analytic == pytest.approx(numeric, rel=1e-6, abs=1e-9)


def test_numpy_peer_keeps_float32(quick_record):
    spec = MODELS["transformer"]
    inputs = spec.inputs(small=True, dtype=np.float32)
    value, grads, cache = run_numpy(spec, inputs)
    assert np.asarray(value).dtype == np.float32
    assert all(g.dtype == np.float32 for g in grads.values())


def test_saved_and_peak_bytes_of_the_numpy_mlp():
    """Hand-written MLP keeps each hidden activation and the softmax probabilities, and the
    inputs x and labels."""
    spec = MODELS["mlp"]
    config = spec.sizes(small=True)
    runner = NumpyRunner(spec, spec.inputs(small=True, dtype=np.float32))
    saved = runner.saved_bytes()
    hidden = config["depth"] * config["batch"] * config["width"] * 4
    assert saved.excluding_inputs == hidden + config["batch"] * config["n_out"] * 4
    inputs = config["batch"] * config["n_in"] * 4 + config["batch"] * 8  # x, int64 labels
    assert saved.including_inputs == saved.excluding_inputs + inputs
    from backplan.bench.measure import traced_peak_bytes

    params_bytes = sum(a.nbytes for a in runner.inputs.params.values())
    assert traced_peak_bytes(runner) >= params_bytes  # every gradient is allocated in the step


class _WrongRunner(NumpyRunner):
    def output(self):
        out = super().output()
        out.grads["w1"] = out.grads["w1"] * 1.01
        return out


class _WrongPeer(NumpyPeer):
    name = "numpy.wrong"

    def build(self, spec, inputs):
        return _WrongRunner(spec, inputs)


class _BrokenPeer(NumpyPeer):
    name = "numpy.broken"

    def build(self, spec, inputs):
        raise RuntimeError("no kernel for this model")


class _WarningPeer(NumpyPeer):
    name = "numpy.fallback"

    def build(self, spec, inputs):
        import warnings

        warnings.warn("graph @mlp runs on the reference interpreter: no kernel", stacklevel=1)
        return super().build(spec, inputs)


def test_a_fast_wrong_answer_shows_as_wrong_and_a_broken_peer_as_an_error():
    peers = [NumpyPeer(), _WrongPeer(), _BrokenPeer(), _WarningPeer()]
    rows = {
        r["peer"]: r
        for r in bench_model(MODELS["mlp"], peers, QUICK_SMALL, Progress(enabled=False))
    }
    assert rows["numpy"]["status"] == "ok"
    assert rows["numpy.wrong"]["status"] == "wrong"
    assert rows["numpy.wrong"]["check"]["worst_grad"] == "w1"
    assert rows["numpy.wrong"]["check"]["grad_rel_error"] == pytest.approx(0.01, rel=1e-3)
    assert rows["numpy.broken"]["status"] == "error"
    assert "no kernel for this model" in rows["numpy.broken"]["note"]
    assert rows["numpy"]["ratio_to_fastest"] is not None
    assert rows["numpy.fallback"]["status"] == "ok"
    assert rows["numpy.fallback"]["warnings"] == [
        "graph @mlp runs on the reference interpreter: no kernel"
    ]
    assert rows["numpy"]["warnings"] == []


def test_markdown_update_keeps_hand_written_notes(quick_record, tmp_path):
    _, _, record, _ = quick_record
    json_path, md_path = tmp_path / "run.json", tmp_path / "BENCHMARKS.md"
    json_path.write_text(json.dumps(record))
    md_path.write_text(f"# Benchmarks\n\nNotes before.\n\n{BEGIN}\nold table\n{END}\n\nAfter.\n")
    code, text = run_cli("--from-json", str(json_path), "--markdown", str(md_path))
    assert code == 0 and "mlp_tiny" in text
    content = md_path.read_text()
    assert "Notes before." in content and "After." in content and "old table" not in content
    assert content.count(BEGIN) == 1 and content.count(END) == 1
    assert record["command"] in content
    assert "| model | backplan | backplan.compile | backplan.reference | numpy |" in content


def test_bad_choices_are_clear_errors(tmp_path, capsys):
    with pytest.raises(BenchError, match="unknown model.*mlp_tiny"):
        select_models(["mlp", "resnet"])
    with pytest.raises(BenchError, match="unknown peer.*tensorflow"):
        select_peers(["tensorflow"])
    assert issubclass(BenchError, bp.BackplanError)
    assert run_cli("--models", "resnet")[0] == 2
    assert "resnet" in capsys.readouterr().err
    (tmp_path / "other.json").write_text('{"schema": "something else"}')
    assert run_cli("--from-json", str(tmp_path / "other.json"))[0] == 2
    assert run_cli("--threads", "0", "--models", "mlp_tiny", "--against", "none")[0] == 2


def test_progress_names_model_and_peer():
    stream = io.StringIO()
    bench_model(MODELS["mlp_tiny"], [NumpyPeer()], QUICK_SMALL, Progress(stream))
    assert "numpy · first call" in stream.getvalue()
    assert "round 2/2" in stream.getvalue()


def _peer_rows(record):
    return [(r["model"], r["peer"], r["status"], r["note"]) for r in record["results"]]


def test_torch_peers_agree_with_the_reference(tmp_path):
    pytest.importorskip("torch")
    path = tmp_path / "torch.json"
    code, _ = run_cli(
        "--quick",
        "--small",
        "--models",
        "mlp_tiny,ln_gelu,mlp_infer",
        "--against",
        "torch",
        "--json",
        str(path),
    )
    record = json.loads(path.read_text())
    assert code == 0, _peer_rows(record)
    torch_rows = [r for r in record["results"] if r["peer"].startswith("torch")]
    assert {r["peer"] for r in torch_rows} == {"torch", "torch.compile"}
    assert all(r["status"] == "ok" for r in torch_rows), _peer_rows(record)
    eager_ln = next(r for r in torch_rows if r["peer"] == "torch" and r["model"] == "ln_gelu")
    assert eager_ln["saved_bytes"]["excluding_inputs"] > 0


def test_jax_peer_agrees_with_the_reference(tmp_path):
    pytest.importorskip("jax")
    path = tmp_path / "jax.json"
    code, _ = run_cli(
        "--quick",
        "--small",
        "--models",
        "mlp_tiny,transformer,ln_gelu",
        "--against",
        "jax",
        "--json",
        str(path),
    )
    record = json.loads(path.read_text())
    assert code == 0, _peer_rows(record)
    jax_rows = [r for r in record["results"] if r["peer"] == "jax"]
    assert len(jax_rows) == 3 and all(r["status"] == "ok" for r in jax_rows)
    assert all(r["peak_bytes"]["planned"] > 0 for r in jax_rows)


def test_cnn_peers_agree_with_the_reference(tmp_path):
    """The CNN's convolutions and pooling through PyTorch eager and JAX, where installed."""
    installed = {"torch": "torch.eager", "jax": "jax"}
    against = [peer for module, peer in installed.items() if importlib.util.find_spec(module)]
    if not against:
        pytest.skip("neither torch nor jax is installed")
    path = tmp_path / "cnn.json"
    code, _ = run_cli(
        "--quick", "--small", "--models", "cnn", "--against", ",".join(against), "--json", str(path)
    )
    record = json.loads(path.read_text())
    assert code == 0, _peer_rows(record)
    rows = {r["peer"]: r for r in record["results"]}
    assert all(r["status"] == "ok" for r in rows.values()), _peer_rows(record)
    assert {"torch" if p == "torch.eager" else p for p in against} <= set(rows)


def test_plot_writes_a_png_of_a_saved_record(quick_record, tmp_path):
    pytest.importorskip("matplotlib")
    _, _, record, _ = quick_record
    json_path, png_path = tmp_path / "run.json", tmp_path / "bench.png"
    json_path.write_text(json.dumps(record))
    assert run_cli("--from-json", str(json_path), "--plot", str(png_path))[0] == 0
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cold_caches_use_an_empty_folder_for_the_run_only(monkeypatch, tmp_path):
    from backplan.bench.caches import CACHE_VARIABLES, FreshCaches

    monkeypatch.setenv("BACKPLAN_CACHE_DIR", str(tmp_path / "mine"))
    with FreshCaches(True) as caches:
        moved = os.environ["BACKPLAN_CACHE_DIR"]
        assert moved != str(tmp_path / "mine") and os.path.isdir(os.path.dirname(moved))
        assert set(caches.describe()["variables"]) >= set(CACHE_VARIABLES.values())
    assert os.environ["BACKPLAN_CACHE_DIR"] == str(tmp_path / "mine")
    assert not os.path.exists(os.path.dirname(moved))
    code, text = run_cli(
        "--quick", "--small", "--models", "mlp_tiny", "--against", "none", "--cold-caches"
    )
    assert code == 0 and "empty disk caches" in text and "--cold-caches" in text


def test_rows_whose_median_is_far_above_their_minimum_are_flagged_noisy():
    from backplan.bench.report.format import footnotes

    steady = {"peer": "numpy", "status": "ok", "step_ms": {"median": 1.1, "min": 1.0}}
    noisy = {"peer": "torch", "status": "ok", "step_ms": {"median": 30.0, "min": 1.0}}
    notes = footnotes([steady, noisy])
    assert len(notes) == 1 and notes[0].startswith("torch: noisy, the median is 30.0x")


def test_a_peer_that_is_not_installed_is_skipped_with_a_note(monkeypatch, tmp_path):
    from backplan.bench.peers.jax_peer import JaxPeer

    monkeypatch.setattr(JaxPeer, "missing", lambda self: "jax is not installed")
    path = tmp_path / "run.json"
    code, text = run_cli(
        "--quick", "--small", "--models", "mlp_tiny", "--against", "jax", "--json", str(path)
    )
    record = json.loads(path.read_text())
    assert code == 0
    assert record["skipped_peers"] == [{"peer": "jax", "reason": "jax is not installed"}]
    assert {r["peer"] for r in record["results"]} == {"backplan", "backplan.compile"}
    assert "skipped jax: jax is not installed" in text


@pytest.fixture
def restore_affinity():
    """Pinning applies to the whole process: put every thread back afterwards."""
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("CPU affinity is Linux-only")
    import numba

    original = os.sched_getaffinity(0)
    threads = numba.get_num_threads()
    yield sorted(original)
    numba.set_num_threads(threads)  # --threads sets Numba's too; later tests expect the default
    for name in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(name), original)
        except ProcessLookupError:
            pass


def test_pinning_reaches_threads_that_already_exist_and_later_ones(restore_affinity):
    import threading

    from backplan.bench.affinity import cpu_list_text, pin_process

    seen = {}
    started, go = threading.Event(), threading.Event()

    def report(name):
        started.set()
        go.wait(10)
        seen[name] = sorted(os.sched_getaffinity(0))

    early = threading.Thread(target=report, args=("early",))
    early.start()
    started.wait(10)
    assert pin_process(1) == {
        "affinity": f"os.sched_setaffinity: CPUs {cpu_list_text(restore_affinity[:1])}"
    }
    late = threading.Thread(target=report, args=("late",))
    late.start()
    go.set()
    early.join(10)
    late.join(10)
    assert seen == {"early": restore_affinity[:1], "late": restore_affinity[:1]}
    assert cpu_list_text([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    with pytest.raises(BenchError, match="may run on only 1 CPUs"):
        pin_process(2)


def test_threads_flag_pins_and_records_affinity_and_cpu(restore_affinity, tmp_path):
    """--threads works without torch, jax or threadpoolctl: the report names the CPUs it ran
    on and the CPU model, in JSON and Markdown."""
    from backplan.bench.environment import cpu_name

    path, markdown = tmp_path / "run.json", tmp_path / "B.md"
    code, text = run_cli(
        "--quick", "--small", "--models", "mlp_tiny", "--against", "none", "--threads", "1",
        "--json", str(path), "--markdown", str(markdown),
    )  # fmt: skip
    assert code == 0, text
    record = json.loads(path.read_text())
    env = record["environment"]
    first = restore_affinity[0]
    assert env["affinity"] == [first] and env["usable_cpus"] == 1 and env["cpu"] == cpu_name()
    settings = env["threads"]["set_by_harness"]
    assert settings["affinity"] == f"os.sched_setaffinity: CPUs {first}"
    assert "threadpoolctl" in settings["blas_and_openmp"]
    assert settings["backplan"].startswith("each step runs OpenBLAS on the free cores")
    line = f"CPU: {cpu_name()} (1 usable of {os.cpu_count()} logical CPUs; affinity CPUs {first})"
    assert line in text and line in markdown.read_text()


def test_each_timed_row_reports_its_rate_against_the_measured_peak(quick_record):
    """GFLOP/s = the model's FLOPs per step (one number for every peer) over the median step;
    % of peak = that over the limit the record states (per-core peak x threads)."""
    _, text, record, _ = quick_record
    limit = record["limit"]
    assert limit["flops_per_core"] > 0 and limit["width"] in (256, 512)
    assert limit["gflops"] == pytest.approx(limit["flops_per_core"] * limit["threads"])
    assert "GFLOP/s per core" in text and "GFLOP/s (% peak)" in text
    for model in record["models"]:
        rows = [r for r in record["results"] if r["model"] == model["name"]]
        assert len({r["flops_per_step"] for r in rows}) == 1
        for row in rows:
            if row["step_ms"] is None:
                assert row["rate"] is None
                continue
            gflops = row["flops_per_step"] / (row["step_ms"]["median"] * 1e-3) / 1e9
            assert row["rate"]["gflops"] == pytest.approx(gflops)
            assert row["rate"]["peak_fraction"] == pytest.approx(gflops / limit["gflops"])


def test_model_flops_count_every_gemm_of_forward_and_backward():
    """The mlp's step is its GEMMs (forward, dX for every layer but the first, dW) and a few
    elementwise passes: the count is at least the GEMMs' and not far above it."""
    from backplan.bench.limits import model_flops
    from backplan.bench.models.mlp import layer_sizes

    spec = MODELS["mlp"]
    config = spec.sizes(small=False)
    sizes, batch = layer_sizes(config), config["batch"]
    gemms = 0
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        products = 2 if i == 0 else 3  # forward and dW; dX too above the first layer
        gemms += products * 2 * batch * fan_in * fan_out
    counted = model_flops(spec, spec.inputs(small=False, dtype=np.float32))
    assert gemms <= counted <= 1.05 * gemms


def test_the_peak_is_measured_once_and_read_back(tmp_path, monkeypatch):
    from backplan.bench import limits

    monkeypatch.setattr(limits, "_peak_path", lambda: str(tmp_path / limits.PEAK_FILE))
    calls = []
    monkeypatch.setattr(
        "backplan.bench.peak_flops.peak_gflops_f32",
        lambda width, seconds, samples: calls.append(width) or 50.0,
    )
    first, second = limits.measured_limit(1), limits.measured_limit(2)
    assert calls == [first.width] and (first.measured, second.measured) == ("now", "cached")
    assert second.gflops == 100.0
    (tmp_path / limits.PEAK_FILE).write_text("not json")  # damaged: measured again
    assert limits.measured_limit(1).measured == "now" and len(calls) == 2
