"""The order the suite's workers take tests in: files holding its longest tests first.

pytest-xdist's `worksteal` (pyproject's addopts) gives each worker half of the collected tests
in order, and a worker that runs out takes the back half of the other's queue, so the last tests
of the run are wherever the two meet. In alphabetical order that was a 24 CPU-second test
(tests/test_hypothesis_registry_graphs.py) started as the other worker finished: one core idle
for the run's last half minute. With the long tests at the front of the first half, both workers
end on short ones. A file keeps its own tests' order.

Measured at 0150156 (fresh clone, empty caches, 2 workers; BENCHMARKS.md 31): every file with a
test over 3.5 CPU s (self + children), longest test first. A file missing here only runs in
alphabetical order after these; a name here that no longer exists is ignored.
"""

from __future__ import annotations

LONG_FILES = (
    "test_hypothesis_registry_graphs.py",
    "test_codegen.py",
    "test_memory_loop.py",
    "test_hypothesis_programs.py",
    "test_view_compositions.py",
    "test_distributed.py",
    "test_attention.py",
    "test_kernel_workspace.py",
    "test_memory_budget_compiled.py",
    "test_memory_check.py",
    "test_library_variants.py",
    "test_memory_while_building.py",
    "test_gemm_bf16.py",
    "test_bench.py",
    "test_library_cache.py",
    "test_bench_compile.py",
    "test_bench_mlp_tiny_fused.py",
    "test_driver_builds.py",
    "test_driver_loop_calls.py",
    "test_driver_tier.py",
    "test_empty_batch.py",
    "test_gemm.py",
    "test_half_ops.py",
    "test_bench_peak_column.py",
    "test_deep_graphs.py",
    "test_packaging.py",
    "test_row_kernel_column_sums.py",
    "test_native_driver.py",
    "test_cache_signing.py",
    "test_object_symbols.py",
    "test_bench_ln_gelu_fused.py",
    "test_disk_cache.py",
    "test_early_updates.py",
)


def long_first(items: list, file_of=lambda item: item.path.name) -> list:
    """items with those of LONG_FILES' files moved to the front, in LONG_FILES' order; the
    rest, and the tests inside each file, in the order they came."""
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    front = sorted(
        (item for item in items if file_of(item) in rank), key=lambda item: rank[file_of(item)]
    )
    return front + [item for item in items if file_of(item) not in rank]
