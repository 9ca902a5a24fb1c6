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
