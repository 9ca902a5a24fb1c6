"""explain counts the pages of backplan's GEMM packing buffers a step's products write
(report.packing_bytes, codegen/kernels/gemm/packing.py) in the peak: the process keeps them from
its first GEMM on; before, the ~0.3-1 MB a thread held there were in no figure explain printed.
A fresh process reads what the buffers hold with mincore."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np

import backplan as bp
from backplan.bench.memory_calls import counted_calls, printed_calls
from backplan.codegen.kernels.gemm.packing import PAGE, bounds, planned_packing
from backplan.codegen.run.memory_check import checked_memory
from backplan.ir.lowering import lower
from backplan.runtime.backend import use_backend

CHILD = """
import ctypes, sys
import numpy as np
import backplan as bp
from backplan.codegen.kernels.gemm import scratch
from backplan.runtime.backend import use_backend


def resident(addr, length):
    libc = ctypes.CDLL(None, use_errno=True)
    start = addr - addr % 4096
    pages = -(-(addr + length - start) // 4096)
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * 4096), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(v & 1 for v in vec) * 4096


m, k, n = (int(a) for a in sys.argv[1:4])
rng = np.random.default_rng(0)
w = bp.tensor(rng.standard_normal((k, n)).astype(np.float32) * 0.05, requires_grad=True)
x = rng.standard_normal((m, k)).astype(np.float32)
f = bp.value_and_grad(lambda w, x: bp.tanh(x @ w).sum())
with use_backend("numba"):
    report = f.explain(w, x)
    for _ in range(2):
        f(w, x)
kept = [int(a) for a in scratch._table[:, 1] if a]
held = sum(resident(a, scratch.MAPPED_BYTES) for a in kept)
print(report.packing_bytes, held)
"""


def test_the_bound_is_the_blocks_one_thread_packs():
    # 64 rows of A by KC, KC by 512 columns of B, the 8 x 32 tile: each rounded up to pages
    assert bounds(64, 512, 300, 4, (8, 32), (256, 128, 2048)) == (65536, 524288, 4096)
    assert bounds(1000, 3000, 100, 8, (8, 16), (256, 128, 2048)) == (102400, 1638400, 4096)
    assert bounds(5, 7, 3, 4, (8, 32), (256, 128, 2048)) == (PAGE, PAGE, PAGE)
    assert bounds(0, 7, 3, 4, (8, 32), (256, 128, 2048)) == (0, 0, 0)


def test_the_packing_panels_a_step_touches_are_what_explain_says_at_most():
    """backplan's GEMM (BACKPLAN_GEMM=own) in a fresh process that maps every block apart
    (MALLOC_MMAP_THRESHOLD_=0): the buffers' resident pages after two steps (300 x 64 @ 64 x
    1000 and its weight gradient) are more than none and at most what explain counts
    (measured on one Zen 4 thread: 303,104 of 303,104 B)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="0", BACKPLAN_GEMM="own")
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD), "300", "64", "1000"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr[-2000:]
    printed, held = map(int, child.stdout.split()[-2:])
    assert 0 < held <= printed, (printed, held)


def test_explain_and_the_checked_mode_count_what_the_gemms_pack_in_the_peak():
    rng = np.random.default_rng(1)
    w = bp.tensor(rng.standard_normal((256, 512)).astype(np.float32) * 0.05, requires_grad=True)
    x = bp.tensor(rng.standard_normal((200, 256)).astype(np.float32))
    with use_backend("numba"), checked_memory():
        f = bp.value_and_grad(lambda w, x: bp.tanh(x @ w).sum())
        report = f.explain(w, x)
        counted = counted_calls(lambda: f(w, x), 2)
    assert counted == printed_calls(report, 2)  # the checked mode counts the packing too
    lowered = [lower(c.plan, c.private_saved) for c in report.peak_calls]
    assert report.packing_bytes == max(planned_packing(low).nbytes for low in lowered)
    own = any(w.startswith("backplan's") for low in lowered for w in low.rendered.gemms.values())
    assert (report.packing_bytes > 0) == own
    assert ("of packing buffers (`packing`)" in str(report)) == own
    assert report.peak.at_peak().get("packing", 0) == report.packing_bytes  # in the peak
    with use_backend("reference"):
        assert (
            bp.value_and_grad(lambda w, x: bp.tanh(x @ w).sum()).explain(w, x).packing_bytes is None
        )
