"""bench.batch_sizes --against-path: each side's warm folder filled at B by its own
installation, then one fresh process a side per round (the order flipped every round), the
package copy first on the child's PYTHONPATH; a row a side, labelled in the table."""

from backplan.bench import batch_sizes


def test_sides_fill_their_folders_then_alternate_and_label_their_rows(monkeypatch):
    calls = []

    def fake(model, mode, sizes, cache, driver="inline", path=None):
        calls.append((len(sizes), path))
        rows = [
            {"size": n, "seconds": 0.1, "cpu": 0.05, "numba": 0, "kernels": 0, "step": 0.01}
            for n in sizes
        ]
        return {"calls": rows, "traces": 1}

    monkeypatch.setattr(batch_sizes, "run_child", fake)
    rows = batch_sizes.measure_against("mlp", 3, "/copy", "default", [10, 12])
    assert calls[:2] == [(1, None), (1, "/copy")]  # the fills, at B only
    assert calls[2:] == [(3, None), (3, "/copy"), (3, "/copy"), (3, None), (3, None), (3, "/copy")]
    assert [row["mode"] for row in rows] == ["dynamic, other", "dynamic, this"]
    table = batch_sizes.markdown(rows, "cmd", 3)
    assert "| dynamic, other |" in table and "| dynamic, this |" in table


def test_the_copy_is_first_on_the_childs_path_and_the_child_starts_outside_the_checkout(
    monkeypatch,
):
    seen = {}

    def fake(command, env, timeout, what, cwd=None):
        seen.update(env=env, cwd=cwd)
        return {}

    monkeypatch.setattr(batch_sizes, "child_result", fake)
    monkeypatch.setenv("PYTHONPATH", "/later")
    batch_sizes.run_child("mlp", "dynamic", [8], "/cache", "default", "/copy")
    assert seen["env"]["PYTHONPATH"].split(":") == ["/copy", "/later"]
    assert seen["cwd"] is not None
    batch_sizes.run_child("mlp", "dynamic", [8], "/cache", "default")
    assert seen["cwd"] is None
