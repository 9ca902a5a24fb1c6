"""bench/memory_programs.py: programs written as a user writes them, each call counted by the
checked mode against the peak explain printed for it (results dropped and kept)."""

from __future__ import annotations

import pytest

from backplan.bench import memory_programs


@pytest.mark.parametrize("name", ["attention", "artifact", "any_batch", "mixed_dtypes"])
def test_each_call_holds_what_explain_prints(name):
    text, same = memory_programs.checked_row(name, 1, calls=3)
    assert same, text
    assert text.startswith(f"| {name} | ") and text.endswith("| equal |")


def test_unknown_programs_are_named(capsys):
    with pytest.raises(SystemExit):
        memory_programs.main(["--check", "--programs", "mlp_adam,nope"])
    assert "no program ['nope']" in capsys.readouterr().err


def test_every_program_is_listed_where_it_can_run():
    assert set(memory_programs.available()) <= set(memory_programs.PROGRAMS)
    assert "mlp_adam" in memory_programs.available()


def test_the_fresh_processes_import_the_programs_by_their_module_name(monkeypatch, capsys):
    """Run as `python -m`, the module is __main__ here; its children import it by name."""
    import json

    from backplan.bench import memory

    calls = []
    found = {k: 1 for k in ("predicted_peak", "inputs", "expected_growth", "measured_growth")}
    found |= {"gemm_packing": 0, "driver_loaded_before": True}

    def fake(function, *args, module):
        calls.append((function, module))
        return json.dumps(found) + "\n"

    monkeypatch.setattr(memory, "_run_child", fake)
    monkeypatch.setattr(memory_programs, "__name__", "__main__")
    assert memory_programs.main(["--programs", "cnn", "--scale", "1"]) == 0
    assert calls == [(f, "backplan.bench.memory_programs") for f in ("warm", "child", "child")]
    assert "| cnn | cnn | 1 | 1 | 1 | 1 | 1 | 0 / 0 |" in capsys.readouterr().out


def test_a_child_that_compiled_its_driver_in_the_step_is_run_again_once(monkeypatch):
    """A void reading (the driver compiled inside the measured step) is retaken, warm first."""
    import json

    from backplan.bench import memory

    calls = []
    loaded = iter([False, True, True, True])

    def fake(function, *args, module):
        calls.append(function)
        if function == "warm":
            return ""
        return json.dumps({"driver_loaded_before": next(loaded), "measured_growth": 1}) + "\n"

    monkeypatch.setattr(memory, "_run_child", fake)
    runs = [("warm", "cnn", 1, 1), ("child", "cnn", 1), ("child", "cnn", 1, 1)]
    found = memory.retried_children(runs, module="backplan.bench.memory_programs")
    assert calls == ["warm", "child", "child", "warm", "child", "child"]
    assert all(f["driver_loaded_before"] for f in found)
