"""The GEMM's block sizes come from the machine's cache sizes (sysfs), with a fallback, and
the GEMM is correct with the blocks of machines other than this one."""

import numpy as np
import pytest

from backplan.codegen.kernels.gemm import blocking


def _cache_tree(root, entries):
    """A fake /sys/devices/system/cpu/cpu0/cache: entries of (level, type, size)."""
    for i, (level, kind, size) in enumerate(entries):
        folder = root / f"index{i}"
        folder.mkdir()
        (folder / "level").write_text(f"{level}\n")
        (folder / "type").write_text(f"{kind}\n")
        (folder / "size").write_text(f"{size}\n")
    return str(root)


def test_sizes_read_from_sysfs_data_and_unified_only(tmp_path):
    folder = _cache_tree(
        tmp_path,
        [
            (1, "Data", "48K"),
            (1, "Instruction", "64K"),
            (2, "Unified", "2048K"),
            (3, "Unified", "105M"),
        ],
    )
    assert blocking.read_cache_sizes(folder) == {1: 48 << 10, 2: 2 << 20, 3: 105 << 20}


def test_missing_or_garbled_sysfs_falls_back(tmp_path):
    assert blocking.read_cache_sizes(str(tmp_path / "absent")) == {}
    folder = _cache_tree(tmp_path, [(1, "Data", "lots"), (2, "Unified", "")])
    assert blocking.read_cache_sizes(folder) == {}
    assert blocking.block_sizes({}) == (256, 128, 2048)  # the measured machine's blocks
    assert blocking.parse_size("1G") == 1 << 30 and blocking.parse_size("x") is None


def test_blocks_follow_each_cache_level():
    base = blocking.block_sizes({1: 32 << 10, 2: 1 << 20, 3: 32 << 20})
    assert base == (256, 128, 2048)
    kc, mc, nc = blocking.block_sizes({1: 48 << 10, 2: 1 << 20, 3: 32 << 20})
    assert kc == 384 and mc == base[1] and nc < base[2]  # a deeper k block, B smaller, A at
    # the 128-row floor (an eighth of L2 would be 80 rows)
    assert blocking.block_sizes({1: 48 << 10, 2: 2 << 20, 3: 32 << 20})[1] == 168
    assert blocking.block_sizes({1: 32 << 10, 2: 2 << 20, 3: 32 << 20})[1] == 256
    assert blocking.block_sizes({1: 32 << 10, 2: 512 << 10, 3: 32 << 20})[1] == 128  # floor
    assert blocking.block_sizes({1: 32 << 10, 2: 1 << 20, 3: 8 << 20})[2] == 512
    tiny = blocking.block_sizes({1: 1 << 10, 2: 1 << 10, 3: 1 << 10})
    huge = blocking.block_sizes({1: 1 << 30, 2: 1 << 30, 3: 1 << 40})
    assert tiny == (64, 128, 256) and huge == (1024, 512, 8192)  # clamped
    for kc, mc, nc in (tiny, huge, base):
        assert kc % 16 == 0 and mc % 8 == 0 and nc % 32 == 0


def test_the_gemm_compiles_this_machines_blocks():
    from backplan.codegen.kernels.gemm import driver

    sizes = blocking.block_sizes(blocking.read_cache_sizes())
    assert (driver.KC, driver.MC, driver.NC) == sizes
    assert f"kc={sizes[0]} mc={sizes[1]} nc={sizes[2]}" in blocking.describe()


@pytest.mark.parametrize(
    "caches", [{1: 16 << 10, 2: 64 << 10, 3: 1 << 20}, {1: 48 << 10, 2: 2 << 20, 3: 8 << 20}]
)
def test_gemm_correct_with_other_machines_blocks(caches):
    """Blocks of a small-cache and a big-L1 machine: several k, row and column blocks, edges."""
    from backplan.codegen.kernels.gemm.driver import gemm_blocked, workspace

    kc, mc, nc = blocking.block_sizes(caches)
    rng = np.random.default_rng(5)
    m, k, n = mc + 13, 2 * kc + 7, nc + 45
    a = rng.standard_normal((k, m)).astype(np.float32)  # op(A) = a.T
    b = rng.standard_normal((k, n)).astype(np.float32)
    c = np.full((m, n), np.nan, np.float32)
    work = workspace(512, c, kc, mc, nc)
    gemm_blocked(512, True, False, 1.0, a, b, 0.0, c, work, kc, mc, nc)
    expected = a.T.astype(np.float64) @ b.astype(np.float64)
    scale = np.abs(a.T).astype(np.float64) @ np.abs(b).astype(np.float64)
    assert np.all(np.abs(c - expected) <= 4 * (k + 2) * np.finfo(np.float32).eps * scale)
