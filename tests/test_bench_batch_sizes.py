"""bench/batch_sizes.py: the table says how many direct drivers each new size built and what
its second call cost, from the child's rows (medians of the calls, the largest build count)."""

from backplan.bench.batch_sizes import _row, markdown


def _call(size, numba=0, drivers=0, step_cpu=0.0002):
    return {
        "size": size, "seconds": 0.05, "cpu": 0.04, "numba": numba, "kernels": 0,
        "step": step_cpu * 2, "step_cpu": step_cpu, "drivers": drivers, "numba_second": 0,
    }  # fmt: skip


def test_the_table_counts_the_direct_drivers_each_size_built():
    runs = [
        {"calls": [_call(8), _call(12, drivers=1, step_cpu=0.6), _call(17)], "traces": 1},
        {"calls": [_call(8), _call(12, drivers=0, step_cpu=0.4), _call(17)], "traces": 1},
    ]
    row = _row("lstm12", "dynamic", runs)
    assert row["calls"][1]["drivers"] == 1  # built in one of the runs: counted
    assert row["calls"][1]["step_cpu"] == 0.5  # the median of the second calls
    text = markdown([row], "python -m backplan.bench.batch_sizes --driver default", 2)
    line = next(x for x in text.splitlines() if x.startswith("| lstm12"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[3] == "50 [40] (1000.0 [500.0])"  # wall [CPU] of the first and second calls
    assert cells[4] == "0 (1)" and cells[7] == "0 (0)"  # Numba compiles (direct drivers built)


def test_the_table_gives_each_new_sizes_first_call_beyond_its_step():
    """The last column: the first call's thread CPU less the second call's, the median of the
    runs' differences (not the difference of medians)."""
    runs = [
        {"calls": [_call(8), {**_call(12, step_cpu=0.030), "cpu": 0.045}, _call(17)], "traces": 1},
        {"calls": [_call(8), {**_call(12, step_cpu=0.040), "cpu": 0.050}, _call(17)], "traces": 1},
        {"calls": [_call(8), {**_call(12, step_cpu=0.020), "cpu": 0.032}, _call(17)], "traces": 1},
    ]
    row = _row("transformer", "dynamic", runs)
    text = markdown([row], "python -m backplan.bench.batch_sizes --sizes 12,17", 3)
    line = next(x for x in text.splitlines() if x.startswith("| transformer"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[9] == "12.0 / 39.8"  # differences 15, 10, 12 -> 12; 17: 40 - 0.2
    runs[0]["calls"][1]["drivers"] = 1  # a second call that built a driver is no step
    row = _row("transformer", "dynamic", runs)
    line = next(x for x in markdown([row], "", 3).splitlines() if x.startswith("| transformer"))
    assert line.strip("|").split("|")[9].strip() == "- / 39.8"


def test_sizes_must_be_two_sizes():
    import pytest

    from backplan.bench.batch_sizes import main

    with pytest.raises(SystemExit):
        main(["--sizes", "12"])
    with pytest.raises(SystemExit):
        main(["--sizes", "0,12"])
