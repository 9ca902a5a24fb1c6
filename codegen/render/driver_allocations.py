"""The driver statements that allocate an array of their own (np.ascontiguousarray of a strided
view, np.full of a literal operand, a copy): memory that neither the plan's prediction nor the
checked mode's counting allocator (codegen/run/memory_check.py) sees, since a compiled driver
makes it inside Numba's runtime. A plan's copies are nodes the memory planner places instead
(ir/strided_copies.py); the checked mode refuses a driver that still makes one, naming its
line, so a new emitter that copies cannot go unnoticed.

Views (reshape of a C-contiguous array, transpose, slicing, np.broadcast_to, .reshape(-1))
allocate nothing: NumPy and Numba both make them without a buffer of their own.
"""

from __future__ import annotations

import re

ALLOCATING = re.compile(
    r"\bnp\.(ascontiguousarray|asfortranarray|empty|empty_like|zeros|zeros_like|ones|ones_like"
    r"|full|full_like|array|copy|concatenate|stack|hstack|vstack|where|dot|matmul)\s*\("
    r"|\.(copy|astype|flatten|ravel|tolist)\s*\("
)
_DRIVER = re.compile(r"^def run(_part\d+)?\(")


def uncounted_allocations(source: str) -> list[str]:
    """Each statement of a generated module's driver functions (`run`, `run_part<i>`) that
    allocates an array, as "line N: <statement> (for <the IR line above it>)"."""
    found, in_driver, ir_line = [], False, None
    for number, line in enumerate(source.splitlines(), 1):
        if not line.startswith((" ", "\t")) and line.strip():
            in_driver = _DRIVER.match(line) is not None
            continue
        text = line.strip()
        if not in_driver or not text:
            continue
        if text.startswith("#"):
            ir_line = text.lstrip("# ")
            continue
        if ALLOCATING.search(text):
            where = f" (for {ir_line})" if ir_line else ""
            found.append(f"line {number}: {text}{where}")
    return found
