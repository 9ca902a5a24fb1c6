"""bench.warm_start --against-path: each side's folder filled by its own installation first,
then one fresh process a side per round, the order flipped every round; the text gives both
sides' samples, the ratio and where each imported backplan from."""

from backplan.bench import warm_start


def test_each_side_fills_its_folder_then_rounds_alternate(monkeypatch):
    calls = []

    def fake(model, cache, path=None, **variables):
        calls.append((cache, path))
        return {"first_call_cpu": 0.1 if path is None else 0.2, "where": path or "here"}

    monkeypatch.setattr(warm_start, "start_once", fake)
    found = warm_start.measure_against("mlp", 3, "/copy", {"this": "A", "other": "B"})
    assert calls == [
        ("A", None),
        ("B", "/copy"),  # the fills, not counted
        ("A", None),
        ("B", "/copy"),
        ("B", "/copy"),
        ("A", None),
        ("A", None),
        ("B", "/copy"),
    ]
    assert found["this"] == [0.1] * 3 and found["other"] == [0.2] * 3
    text = warm_start.against_text("mlp", found)
    assert "0.500x, this lower in 3 of 3 rounds" in text
    assert "other imported from /copy, this from here" in text
