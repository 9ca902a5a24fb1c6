"""The GEMM's block sizes (kc, mc, nc) from the machine's cache sizes, read once per process.

Each block is sized to the cache level that holds it while the loops around it run
(driver.py's BLIS loop order): a kc x nr panel of B is reused by every A panel of a row
block, so kc is what fills L1 with one panel of the widest tile (32 f32 columns, 128 bytes a
row); an mc x kc block of packed A streams through the micro-kernel once per B panel, so it
takes an eighth of L2, but never fewer than 128 rows; a kc x nc block of packed B is reused by
every row block, so it takes a sixteenth of L3. The fractions are the ones that reproduce the
sizes measured best on Zen 4 (L1d 32 KiB, L2 1 MiB, L3 32 MiB: kc 256, mc 128, nc 2048;
bench/gemm.py), and the fallback when sysfs says nothing is that machine's caches. The floor
of 128 rows is Zen 5's (L1d 48 KiB, so kc 384 and an eighth of L2 only 80 rows): a batch of
128 rows then takes two row blocks, and the GEMM packs B, which it reads in place for one row
block (driver.py). With 128 rows, one pinned core, thread CPU, medians of 5-7 interleaved
rounds at load 15-16: mlp's 128x512x784 and 128x512x512 products 200-216 -> 225-236 GFLOP/s,
in its step 5-10% less time for each of them; the other bench shapes within the noise. Sizes
are in elements and serve every tile and dtype (f64 blocks take twice the bytes, as they did
with fixed sizes).

    >>> block_sizes({1: 48 << 10, 2: 2 << 20, 3: 32 << 20})
    (384, 168, 1344)
    >>> block_sizes({1: 48 << 10, 2: 1 << 20, 3: 32 << 20})  # Zen 5: the floor
    (384, 128, 1344)
    >>> block_sizes({})  # nothing read: the measured machine's caches
    (256, 128, 2048)
"""

from __future__ import annotations

import functools
import os

CACHE_FOLDER = "/sys/devices/system/cpu/cpu0/cache"
FALLBACK = {1: 32 << 10, 2: 1 << 20, 3: 32 << 20}  # bytes per level: Zen 4, where measured
PANEL_ROW_BYTES = 128  # one row of the widest B panel: 32 f32 columns (512-bit tile, 2 vectors)
A_SHARE_OF_L2, B_SHARE_OF_L3 = 8, 16
KC_RANGE, MC_RANGE, NC_RANGE = (64, 1024), (128, 512), (256, 8192)  # mc: the floor above
KC_STEP, MC_STEP, NC_STEP = 16, 8, 32  # mc: a multiple of the 8-row tile; nc: of 32 columns
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int | None:
    """Bytes of a sysfs cache size ("32K", "1024K", "32M", "65536"); None when unreadable."""
    text = text.strip().upper()
    scale = _UNITS.get(text[-1:], 1)
    digits = text[:-1] if text[-1:] in _UNITS else text
    return int(digits) * scale if digits.isdigit() else None


def read_cache_sizes(folder: str = CACHE_FOLDER) -> dict[int, int]:
    """{level: bytes} of the data and unified caches CPU 0 sees (levels 1-3); levels sysfs
    does not list (a container without /sys, another OS) are missing."""
    sizes: dict[int, int] = {}
    try:
        entries = sorted(os.listdir(folder))
    except OSError:
        return sizes
    for entry in entries:
        if not entry.startswith("index"):
            continue
        level, kind, size = (
            _read(os.path.join(folder, entry, n)) for n in ("level", "type", "size")
        )
        if kind not in ("Data", "Unified") or not level.isdigit():
            continue
        parsed = parse_size(size)
        if parsed and 1 <= int(level) <= 3:
            sizes[int(level)] = parsed
    return sizes


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _fit(value: float, bounds: tuple[int, int], step: int) -> int:
    """value rounded down to a multiple of step, within bounds."""
    low, high = bounds
    return max(low, min(high, int(value) // step * step))


def block_sizes(caches: dict[int, int]) -> tuple[int, int, int]:
    """(kc, mc, nc) in elements for these cache sizes ({level: bytes}; FALLBACK fills gaps)."""
    l1, l2, l3 = (caches.get(level) or FALLBACK[level] for level in (1, 2, 3))
    kc = _fit(l1 / PANEL_ROW_BYTES, KC_RANGE, KC_STEP)
    mc = _fit(l2 / A_SHARE_OF_L2 / (kc * 4), MC_RANGE, MC_STEP)
    nc = _fit(l3 / B_SHARE_OF_L3 / (kc * 4), NC_RANGE, NC_STEP)
    return kc, mc, nc


@functools.cache
def machine_block_sizes() -> tuple[int, int, int]:
    """block_sizes of this machine's caches: what the GEMM compiled here uses."""
    return block_sizes(read_cache_sizes())


def describe() -> str:
    """The block sizes and the caches they come from, for cache keys and reports."""
    caches = read_cache_sizes()
    read = ", ".join(f"L{level} {size >> 10} KiB" for level, size in sorted(caches.items()))
    kc, mc, nc = machine_block_sizes()
    return f"kc={kc} mc={mc} nc={nc} ({read or 'caches unknown: fallback'})"
