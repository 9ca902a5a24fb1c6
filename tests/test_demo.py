"""`python -m backplan demo`: the numbers it prints about the backward plan agree."""

import io
import re

import numpy as np

from backplan.demo import show_backward_plan


def test_the_live_bytes_line_adds_up_to_the_tables_held_bytes():
    rng = np.random.default_rng(0)
    x, labels = rng.standard_normal((8, 32)).astype(np.float32), rng.integers(0, 10, 8)
    out = io.StringIO()
    show_backward_plan(x, labels, out)
    text = out.getvalue()
    held = int(re.search(r"saved buffer\(s\), (\d+) B held", text).group(1))
    line = re.search(
        r"live saved bytes: (\d+) allocated .* (\d+) of your own .*: (\d+) B held", text
    )
    allocated, yours, total = (int(g) for g in line.groups())
    assert yours > 0 and allocated > 0
    assert allocated + yours == total == held
    assert "after backward:   0" in text
