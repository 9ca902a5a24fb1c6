"""The BLAS calls read every buffer they are given until they return. Run where glibc maps each
allocation on its own pages (MALLOC_MMAP_THRESHOLD_=0), so a buffer freed before the call that
reads it is unmapped and the read faults instead of finding the old bytes still there."""

import os
import subprocess
import sys

import numpy as np

SCRIPT = """
import numpy as np
from backplan.codegen.kernels.blas import gemm_rows
rng = np.random.default_rng(0)
a, b = rng.standard_normal((5, 7)), rng.standard_normal((4, 7))
out = rng.standard_normal((5, 4))
expected = 2.0 * a @ b.T + 0.5 * out
for dtype in (np.float32, np.float64):
    o = out.astype(dtype)
    gemm_rows(False, True, 2.0, a.astype(dtype), b.astype(dtype), 0.5, o)
    print(float(np.max(np.abs(o - expected))))
"""


def test_gemm_rows_keeps_alpha_and_beta_alive_through_the_blas_call():
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "0"}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr[-2000:]}"
    f32_error, f64_error = (float(line) for line in result.stdout.split())
    assert f32_error < 1e-5 and f64_error < 1e-12
    assert np.isfinite([f32_error, f64_error]).all()
