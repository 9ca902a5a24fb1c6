"""bench/frontier_parts.py: the passes of memory_frontier's rows timed where their callers look
them up, and put back afterwards."""

from backplan.bench import frontier_parts, internals
from backplan.runtime.backend import use_backend


def _current(where: str, attribute: str):
    owner = getattr(internals, where)
    return owner.__dict__[attribute] if isinstance(owner, type) else getattr(owner, attribute)


def test_each_row_pass_is_timed_once_per_row_and_put_back():
    before = {label: _current(w, a) for label, w, a, _ in frontier_parts.PARTS}
    with use_backend("numba"):  # rows lowered (the reference interpreter simulates them)
        trace, total, rows, found = frontier_parts.frontier_parts(layers=6)
    assert rows >= 2 and 0 < trace and 0 < total
    lowered = found["lowering"][1]
    assert lowered >= rows - 1  # the default plan was lowered by the trace already
    sized = "arena sized from the lifetimes"
    for label in ("fusion grouping", "layout", sized, "a row's saved column (fused values)"):
        assert found[label][1] == lowered, label
    assert found["placement (where that cannot size it)"][1] <= lowered
    assert found["lowering"][0] <= found["a row's peak"][0]
    assert {label: _current(w, a) for label, w, a, _ in frontier_parts.PARTS} == before
    nodes, plans = found[frontier_parts.NODES]
    assert plans == lowered and nodes >= plans * 6 * 4  # each plan: >= 4 nodes a layer
    text = frontier_parts.parts_text(trace, total, rows, found)
    assert f"({rows} rows;" in text and "      placement (where" in text
    assert f"{nodes:,} nodes lowered" in text and "us a node" in text
