"""bench/first_minute.py's summary: the first step within 10% of the steady one, and the wall
time to reach it, from (start offset, seconds) rows as a child reports them."""

from backplan.bench.first_minute import summary


def test_the_first_steady_step_and_the_wall_time_to_it():
    rows = [(0.0, 2.0)]  # the cold first call
    rows += [(2.0 + 0.01 * i, 0.01) for i in range(10)]  # Python-run driver: 10 ms
    rows += [(2.1 + 0.002 * i, 0.002) for i in range(200)]  # compiled: 2 ms
    result = summary("mlp", {"rows": rows, "tier": "compiled", "compiled_step": 11})
    assert result["first_call_s"] == 2.0
    assert result["early_step_ms"] == 10.0 and result["steady_step_ms"] == 2.0
    assert result["first_steady_step"] == 11
    assert result["wall_to_steady_s"] == 2.102
    assert result["tier_at_end"] == "compiled"
    assert result["compiled_step"] == 11 and result["wall_to_compiled_s"] == 2.102


def test_a_run_that_never_reached_the_compiled_driver_says_so():
    """Its last steps are the Python-run driver's: "steady" is not compiled speed."""
    rows = [(0.0, 2.0)] + [(2.0 + 0.01 * i, 0.01) for i in range(100)]
    result = summary("lstm12", {"rows": rows, "tier": "python", "compiled_step": None})
    assert result["first_steady_step"] == 1 and result["tier_at_end"] == "python"
    assert result["compiled_step"] is None and result["wall_to_compiled_s"] is None


def test_the_target_ratio_and_the_medians_per_model_and_variant():
    """steady_over_first_call is the wall time to the steady step over the first call; the
    medians keep each run's value and say None where a run never reached compiled speed."""
    from backplan.bench.first_minute import medians, variant

    rows = [(0.0, 1.0)] + [(1.0 + 0.002 * i, 0.002) for i in range(100)]
    fast = summary("mlp", {"rows": rows, "tier": "compiled", "compiled_step": 1})
    assert fast["steady_over_first_call"] == 1.0
    slow = dict(fast, wall_to_steady_s=3.0, compiled_step=None, wall_to_compiled_s=None)
    other = dict(fast, wall_to_steady_s=2.0)
    lines = medians([
        {**fast, "variant": "a"}, {**slow, "variant": "a"}, {**other, "variant": "a"},
        {**fast, "variant": "b"},
    ])  # fmt: skip
    assert lines[("mlp", "a")]["wall_to_steady_s"] == 2.0
    assert lines[("mlp", "a")]["wall_to_steady_s_runs"] == [1.002, 3.0, 2.0]
    assert lines[("mlp", "a")]["wall_to_compiled_s"] is None  # one run never compiled
    assert lines[("mlp", "b")]["runs"] == 1
    assert variant(["x", "/bin/py", "A=1", "B=c=d"]) == ("x", "/bin/py", {"A": "1", "B": "c=d"})
