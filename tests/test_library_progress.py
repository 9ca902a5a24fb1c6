"""A heavy library kernel's first compile is never silent under BACKPLAN_VERBOSE=1: a line when
it starts (its name, the dtypes, the predicted seconds) and one when it ends; nothing when it is
loaded or already compiled, nothing under BACKPLAN_QUIET=1; by default it is at most the
process's one line about compiling (tests/test_quiet_by_default.py)."""

import numba
import numpy as np
import pytest

from backplan.codegen.build.library_progress import announce_compiles


def _fresh_library_function():
    @numba.njit
    def scaled_sum(x, scale):
        return (x * scale).sum()

    announce_compiles({scaled_sum: 7.0})
    return scaled_sum


@pytest.mark.parametrize("quiet", [False, True])
def test_heavy_library_compile_says_when_it_starts_and_ends(quiet, monkeypatch, capfd):
    monkeypatch.setenv("BACKPLAN_QUIET", "1" if quiet else "0")
    monkeypatch.setenv("BACKPLAN_VERBOSE", "1")
    scaled_sum = _fresh_library_function()
    capfd.readouterr()
    assert scaled_sum(np.arange(4, dtype=np.float32), 2.0) == pytest.approx(12.0)
    assert scaled_sum(np.ones(3, np.float32), 1.0) == pytest.approx(3.0)  # compiled: no line
    lines = [line for line in capfd.readouterr().err.splitlines() if "scaled_sum" in line]
    if quiet:
        assert lines == []
        return
    assert len(lines) == 2, lines
    assert "compiling the library's scaled_sum for float32 arrays" in lines[0]
    assert "about 7 s" in lines[0]
    assert lines[1].startswith("backplan: compiled scaled_sum in ") and lines[1].endswith(" s")


def test_unregistered_compiles_say_nothing(monkeypatch, capfd):
    monkeypatch.setenv("BACKPLAN_QUIET", "0")
    monkeypatch.setenv("BACKPLAN_VERBOSE", "1")

    @numba.njit
    def plain(x):
        return x + 1

    capfd.readouterr()
    assert plain(1) == 2
    assert "backplan:" not in capfd.readouterr().err


def test_library_conv_and_attention_register_their_heavy_kernels():
    from backplan.codegen.build.library_progress import _MEASURED
    from backplan.codegen.kernels import attention as library_attention
    from backplan.codegen.kernels import conv as library_conv

    for kernel in (
        library_conv.conv2d_gemm,
        library_conv.conv2d_weight_grad_gemm,
        library_attention.attention_forward,
        library_attention.attention_backward_par,
    ):
        assert _MEASURED[id(kernel)][0] is kernel
        assert _MEASURED[id(kernel)][1] >= 2.0


def test_by_default_a_quick_library_compile_says_nothing(monkeypatch, capfd):
    """Not verbose: the compile counts toward the process's one line, printed only once a
    compile has run past BACKPLAN_PROGRESS_SECONDS."""
    monkeypatch.delenv("BACKPLAN_VERBOSE", raising=False)
    monkeypatch.delenv("BACKPLAN_QUIET", raising=False)
    monkeypatch.setenv("BACKPLAN_PROGRESS_SECONDS", "1000")
    scaled_sum = _fresh_library_function()
    capfd.readouterr()
    assert scaled_sum(np.arange(4, dtype=np.float32), 2.0) == pytest.approx(12.0)
    assert "backplan:" not in capfd.readouterr().err
