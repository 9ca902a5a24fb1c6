"""bench/compile_profile.py: a cold first call's compiles, by function."""

import json
import os
import subprocess
import sys

import numba
from numba.core import event

from backplan.bench import compile_profile


def test_a_compile_nested_in_another_counts_for_itself_and_names_its_caller():
    @numba.njit
    def inner(x):
        return x * 2.0

    @numba.njit
    def outer(x):
        return inner(x) + 1

    times = compile_profile.CompileTimes()
    with event.install_listener("numba:compile", times):
        outer(1.5)
    names = {name.rsplit(".", 1)[-1]: name for name in times.exclusive}
    inner_name, outer_name = names["inner"], names["outer"]
    assert times.asked_by[inner_name] == outer_name
    assert inner_name not in times.asked_by.get(outer_name, "")
    assert list(times.top_level) == [outer_name]
    outer_total = times.top_level[outer_name]
    assert outer_total >= times.exclusive[outer_name] + times.exclusive[inner_name] - 1e-9
    assert times.variants == {inner_name: 1, outer_name: 1}


def test_a_models_first_call_lists_its_compiled_loop_kernels(tmp_path):
    """In a fresh process, as the bench runs it: in this one another test may have compiled
    the same kernels already (the process keeps them), and nothing would compile."""
    env = dict(os.environ, BACKPLAN_CACHE_DIR=str(tmp_path), BACKPLAN_BACKEND="numba")
    path = tmp_path / "facts.json"
    run = [sys.executable, "-m", "backplan.bench.compile_profile", "mlp_tiny", "--small"]
    subprocess.run([*run, "--json", str(path)], env=env, check=True, capture_output=True)
    facts = json.loads(path.read_text())
    kernels = [f for f in facts["functions"] if f["name"].startswith("backplan_kernel_")]
    assert kernels and all(f["variants"] >= 1 and f["cpu_s"] >= 0 for f in kernels)
    assert 0 < facts["compile_cpu_s"] <= facts["first_call_cpu_s"]
    text = compile_profile.report(facts, rows=5)
    assert text.startswith("mlp_tiny: first call") and facts["functions"][0]["name"] in text
    stages = facts["stages"]
    assert abs(sum(stages.values()) - facts["first_call_cpu_s"]) < 1e-6  # they add up
    assert stages["loops: Numba typing and lowering"] > 0, stages  # an empty cache: they compile
    assert stages["trace"] > 0 and stages["plan (lowering, layout, memory)"] > 0
    assert "loops: Numba typing and lowering" in text


def test_the_stage_wrappers_time_exclusively_and_are_removed_afterwards():
    from backplan.codegen.build import loop_batch

    original = loop_batch.compile_together
    stages = compile_profile.StageTimes()
    stages.install()
    try:
        assert loop_batch.compile_together is not original
        loop_batch.compile_together([])  # nothing to compile: returns at once
    finally:
        stages.restore()
    assert loop_batch.compile_together is original
    assert 0 <= stages.seconds["compile the loops"] < 0.5
    assert all(
        seconds == 0 for stage, seconds in stages.seconds.items() if stage != "compile the loops"
    )
