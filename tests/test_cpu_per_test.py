"""tests/cpu_per_test.py's compile times: each test's row names the functions Numba compiled
in it, each with its own CPU (a driver's nested loop compiles not counted twice), and the run's
report adds them up by function."""

import types

import cpu_per_test
import numba
import numpy as np
from cpu_per_test import CompileTimes, compiled_name, listen
from numba.core import event


def _event(module: str, name: str):
    function = types.SimpleNamespace(__module__=module, __qualname__=name)
    return types.SimpleNamespace(data={"dispatcher": types.SimpleNamespace(py_func=function)})


def test_a_compile_inside_another_counts_once_in_its_own_name(monkeypatch):
    clock = iter([0.0, 1.0, 3.5, 4.0])  # driver starts, loop starts, loop ends, driver ends
    monkeypatch.setattr(cpu_per_test.time, "thread_time", lambda: next(clock))
    times = CompileTimes()
    driver, loop = _event("backplan_kernels_ab12", "run"), _event("backplan_kernel_k_9f", "kernel")
    times.on_start(driver)
    times.on_start(loop)
    times.on_end(loop)
    times.on_end(driver)
    assert times.take() == {"<loop>.kernel": 2.5, "<driver>.run": 1.5}
    assert times.take() == {}  # taken


def test_generated_modules_are_named_by_kind_and_others_by_module():
    assert compiled_name(_event("backplan_kernels_0f3", "run").data["dispatcher"]) == "<driver>.run"
    kernel = _event("backplan_kernel_k_77", "kernel_at").data["dispatcher"]
    assert compiled_name(kernel) == "<loop>.kernel_at"
    library = _event("backplan.codegen.kernels.rows", "softmax_rows").data["dispatcher"]
    assert compiled_name(library) == "backplan.codegen.kernels.rows.softmax_rows"
    assert compiled_name(None) == "?.?"


def test_numbas_compiles_are_heard_by_name():
    @numba.njit
    def inner(x):
        return x * 2.0

    @numba.njit
    def outer(x):
        return inner(x) + 1.0

    times = CompileTimes()
    listener = listen(times)
    try:
        assert outer(np.float64(1.5)) == 4.0
    finally:
        event.unregister("numba:compile", listener)
    heard = times.take()
    prefix = f"{__name__}.test_numbas_compiles_are_heard_by_name.<locals>."
    assert set(heard) >= {prefix + "inner", prefix + "outer"}, heard
    assert all(seconds > 0 for seconds in heard.values()), heard


def test_the_report_adds_up_each_functions_compiles(tmp_path):
    path = str(tmp_path / "cpu.json")
    rows = [
        {
            "test": "t::a",
            "file": "t.py",
            "self_s": 2.0,
            "children_s": 0.0,
            "wall_s": 2.0,
            "worker": "gw0",
            "compiled": {"<driver>.run": 1.25, "lib.f": 0.5},
        },
        {
            "test": "t::b",
            "file": "t.py",
            "self_s": 1.0,
            "children_s": 0.5,
            "wall_s": 1.5,
            "worker": "gw1",
            "compiled": {"<driver>.run": 0.75},
        },
        {
            "test": "t::c",
            "file": "t.py",
            "self_s": 0.1,
            "children_s": 0.0,
            "wall_s": 0.1,
            "worker": "gw1",
        },  # a row written before rows kept compiles
    ]
    with open(f"{path}.gw0.jsonl", "w") as f:
        f.write("\n".join(__import__("json").dumps(r) for r in rows) + "\n")
    summary = cpu_per_test._summary(path)
    assert summary["compiled"] == {
        "<driver>.run": {"seconds": 2.0, "tests": 2},
        "lib.f": {"seconds": 0.5, "tests": 1},
    }
    assert summary["compiled_s"] == 2.5
    report = cpu_per_test._report(summary)
    assert "Numba compiling in the tests' own processes: 2.5 CPU s" in report
    assert "     2.0     2  <driver>.run" in report
