"""bench/child.py: the fresh-process measurements (warm_start, first_minute, export_start,
batch_sizes) read their child's result from its last stdout line and fail naming the child
with the end of its stderr."""

import os
import sys

import pytest

from backplan.bench.child import child_result


def test_the_last_line_is_the_result():
    code = "print('compiling...'); print('{\"seconds\": 1.5}')"
    assert child_result([sys.executable, "-c", code], dict(os.environ), 60, "x") == {"seconds": 1.5}


def test_a_failed_child_is_named_with_its_stderr():
    code = "import sys; sys.stderr.write('no kernel cache here'); sys.exit(3)"
    with pytest.raises(RuntimeError, match=r"(?s)warm-start child failed \(exit 3\).*no kernel"):
        child_result([sys.executable, "-c", code], dict(os.environ), 60, "warm-start child")
