"""bench/frontier_rows.py --against / --against-path: two installations' frontiers in alternated
fresh processes started outside any checkout. Here both sides are this installation (the path
given holds no package), so each must find backplan where this process does and the same rows."""

import backplan as bp
from backplan.bench import frontier_rows


def test_two_installations_alternate_in_fresh_processes_and_compare_rows(tmp_path):
    found = frontier_rows.against(None, str(tmp_path), rounds=2, layers=6)
    assert len(found["this"]) == len(found["other"]) == 2
    assert all(s > 0 for s in found["this"] + found["other"])
    assert found["where"] == {"this": bp.__file__, "other": bp.__file__}
    assert found["same"] is True
    text = frontier_rows.against_text(found)
    assert "the same rows and floor: True" in text and text.count(bp.__file__) == 2
