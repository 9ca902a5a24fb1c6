"""conv2d's kernels work in a buffer of the plan's scratch arena (ir/kernel_workspace.py), passed
to them as an argument: a compiled conv step allocates nothing inside its kernels, the checked
mode counts every byte explain prints, and the process holds from its second call what it held
after its first. Allocated inside the kernels on every call, from the second call glibc served
the columns from its heap and kept them: the bench CNN held 22-56 MB more than printed. The
library's other per-call allocations are counted the same way (Numba's allocation count): the
batched GEMM's packing buffers."""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest

import backplan as bp
from backplan.bench.internals import checked_memory, measure
from backplan.codegen.render.emit import generate
from backplan.ir.kernel_workspace import conv_workspace_elements
from backplan.ir.lowering import lower
from backplan.ir.peak import joint_calls, predicted_peak
from backplan.ir.printer import value_names
from backplan.runtime.backend import use_backend
from tests.helpers import script_facts

N, C, H, K = 16, 4, 10, 6  # batch, channels in, image side, channels out (3x3 kernels, padding 1)


def _conv_inputs():
    rng = np.random.default_rng(0)
    w = bp.tensor(rng.standard_normal((K, C, 3, 3)).astype(np.float32))
    x = bp.tensor(rng.standard_normal((N, C, H, H)).astype(np.float32))
    return w, x


def _conv_loss(w, x):
    return bp.tanh(bp.conv2d(x, w, padding=1)).sum()


def test_the_columns_are_a_buffer_of_the_arena_live_at_their_kernel_only():
    w, x = _conv_inputs()
    plan = bp.value_and_grad(_conv_loss).trace(w, x).plan
    lowered = lower(plan)
    columns = conv_workspace_elements(N, (H, H), K, C * 9, 1)
    convs = [k.nodes[0] for k in lowered.kernels if k.kind == "op"]
    convs = [n for n in convs if n.op.startswith("conv2d")]
    assert [n.op for n in convs] == ["conv2d", "conv2d_weight_grad"]  # x needs no gradient
    assert [n for n, _ in lowered.layout.workspaces.items()] == convs
    assert all(count == columns for _, count in lowered.layout.workspaces.values())
    # held at their kernels' steps alone, they share bytes with what is dead then
    layout = lowered.layout
    apart = 2 * columns * 4 + sum(map(layout.reserved_bytes, layout.scratch_offsets))
    assert columns * 4 <= layout.scratch_bytes < apart
    first = next(iter(layout.workspaces.values()))[0]
    source = generate(lowered).source  # rendered, not compiled: the call passes the slice
    assert f"scratch_f32[{first}:{first + columns}], 1, 1, 1, 1, 1, 1, 1," in source
    described = layout.describe(value_names(lowered.plan.graph))
    assert [b for _, _, b in described["workspaces"].values()] == [columns * 4] * 2  # exports'
    report = predicted_peak(joint_calls(plan, 1), "numba")
    assert "workspace" not in report.at_peak()
    assert report.allocated_peak_bytes == report.peak_bytes - report.input_bytes


def test_a_refused_budget_names_the_workspace_among_the_arenas_largest_buffers():
    w, x = _conv_inputs()
    step = bp.value_and_grad(_conv_loss, max_peak_bytes=100_000)
    with use_backend("numba"), pytest.raises(bp.MemoryBudgetError) as refused:
        step(w, x)
    columns = conv_workspace_elements(N, (H, H), K, C * 9, 1) * 4
    assert f"conv2d's workspace {columns:,} B" in str(refused.value)


def test_the_checked_mode_counts_what_explain_prints_to_the_byte():
    """Every byte of the workspace goes through the counting allocator (it is the arena's)."""
    w, x = _conv_inputs()
    with use_backend("numba"), checked_memory():
        step = bp.value_and_grad(_conv_loss, argnums=(0, 1))
        with measure() as measured:
            last = step(w, x)
            measured.restart_at_next_use()
            last = step(w, x)
        del last
        peak = step.explain(w, x).peak
    assert measured.peak == peak.allocated_peak_bytes
    assert peak.at_peak()["scratch"] >= conv_workspace_elements(N, (H, H), K, C * 9, 1) * 4


@pytest.mark.parametrize(
    "case",
    [  # (x shape, w shape, stride, padding, dilation, groups): odd sizes, every attribute
        ((3, 4, 7, 9), (6, 2, 3, 2), (2, 1), (1, 2), (1, 2), 2),
        ((5, 3, 6, 5), (4, 3, 2, 3), (1, 2), (0, 1), (2, 1), 1),
        ((0, 3, 6, 5), (4, 3, 3, 3), (1, 1), (1, 1), (1, 1), 1),  # an empty batch
    ],
)
def test_compiled_conv_values_and_gradients_equal_the_reference(case):
    x_shape, w_shape, stride, padding, dilation, groups = case
    rng = np.random.default_rng(1)
    x = bp.tensor(rng.standard_normal(x_shape).astype(np.float32))
    w = bp.tensor(rng.standard_normal(w_shape).astype(np.float32))

    def loss(w, x):
        y = bp.conv2d(x, w, stride=stride, padding=padding, dilation=dilation, groups=groups)
        return bp.sum(bp.tanh(y) * y)

    expected, expected_grads = bp.value_and_grad(loss, argnums=(0, 1))(w, x)
    with use_backend("numba"), checked_memory():
        step = bp.value_and_grad(loss, argnums=(0, 1))
        for _ in range(2):  # the second call reuses the arena the first wrote
            value, grads = step(w, x)
            np.testing.assert_allclose(value.numpy(), expected.numpy(), rtol=1e-4, atol=1e-4)
            for got, want in zip(grads, expected_grads, strict=True):
                np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("gemm", ["own", "blas"])
def test_from_its_second_call_a_conv_step_allocates_nothing_in_compiled_code(gemm, monkeypatch):
    """Numba's allocation count (NRT) over calls 3..6 of a compiled conv step, every product
    on backplan's GEMM or on BLAS: its kernels allocated their columns, products and weights
    on every call (15 allocations a call of this step), and BLAS's alpha and beta (gemm_rows)
    one per product."""
    monkeypatch.setenv("BACKPLAN_GEMM", gemm)
    rng = np.random.default_rng(2)
    w1 = bp.tensor(rng.standard_normal((8, 3, 3, 3)).astype(np.float32))
    w2 = bp.tensor(rng.standard_normal((8, 8, 3, 3)).astype(np.float32))
    x = bp.tensor(rng.standard_normal((8, 3, 12, 12)).astype(np.float32))

    def loss(w1, w2, x):
        h = bp.relu(bp.conv2d(x, w1, padding=1))
        return bp.sum(bp.tanh(bp.conv2d(h, w2, padding=1, stride=2)))

    with use_backend("numba"), _allocations_counted() as allocated:
        step = bp.value_and_grad(loss, argnums=(0, 1))
        counts = []
        for _ in range(6):
            before = allocated()
            step(w1, w2, x)
            counts.append(allocated() - before)
    assert counts[2:] == [0, 0, 0, 0], counts


def test_a_batched_product_shared_out_by_entries_allocates_no_packing_buffers():
    """Each entry of a batched product on the parallel (or one-core batch) path packed into a
    workspace of its own, MC x KC + NC x KC elements whatever the entry's size: three
    allocations per entry per call. It packs into a kept slot now: a call allocates what
    boxing its three arrays does, as a function doing nothing with them."""
    from backplan.codegen.jit import njit
    from backplan.codegen.kernels.gemm.isa import vector_width
    from backplan.codegen.kernels.gemm.parallel import batched_gemm_parallel, gemm_serial_batch

    rng = np.random.default_rng(4)
    a = rng.standard_normal((8, 16, 24)).astype(np.float32)
    b = rng.standard_normal((8, 24, 12)).astype(np.float32)
    c = np.empty((8, 16, 12), np.float32)
    nothing = njit(lambda a, b, c: None)

    with _allocations_counted() as allocated:

        def allocations(call) -> int:
            call()  # compiled, slots taken
            before = allocated()
            call()
            return allocated() - before

        boxing = allocations(lambda: nothing(a, b, c))
        for batched in (batched_gemm_parallel, gemm_serial_batch):
            made = allocations(lambda: batched(vector_width(), False, False, a, b, c))  # noqa: B023
            assert made == boxing, (batched, made, boxing)
            np.testing.assert_allclose(c, a @ b, rtol=1e-5, atol=1e-5)


@contextlib.contextmanager
def _allocations_counted():
    """A function giving the number of allocations Numba's runtime has made (every np.empty
    in compiled code, and a meminfo per array a Python call boxes), counted while inside."""
    from numba.core.runtime import _nrt_python, rtsys

    was_counting = _nrt_python.memsys_stats_enabled()
    _nrt_python.memsys_enable_stats()
    try:
        yield lambda: rtsys.get_allocation_stats().alloc
    finally:
        if not was_counting:
            _nrt_python.memsys_disable_stats()


_RESIDENT = """
import json, sys
import numpy as np
import backplan as bp
from backplan.runtime.backend import use_backend

def status(field):
    return [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(field)][0]

rng = np.random.default_rng(0)
w1 = rng.standard_normal((16, 3, 3, 3)).astype(np.float32) * 0.2
w2 = rng.standard_normal((16, 16, 3, 3)).astype(np.float32) * 0.1
x = rng.standard_normal((64, 3, 24, 24)).astype(np.float32)

def loss(w1, w2, x):
    h = bp.relu(bp.conv2d(x, w1, padding=1))
    return bp.sum(bp.tanh(bp.conv2d(h, w2, padding=1, stride=2)))

with use_backend("numba"):
    step = bp.value_and_grad(loss, argnums=(0, 1))
    if sys.argv[1] == "warm":
        for _ in range(3):  # compiled into the cache folder, the direct driver too (call 2)
            step(w1, w2, x)
        print("{}")
        raise SystemExit
    report = step.explain(w1, w2, x)  # traced and lowered; kernels and driver load on call 1
    open("/proc/self/clear_refs", "w").write("5")
    before = status("VmRSS")
    grown = []
    for _ in range(6):
        value, grads = step(w1, w2, x)
        del value, grads
        grown.append(status("VmHWM") - before)
print(json.dumps({"grown": grown, "scratch": report.peak.at_peak()["scratch"]}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc")
def test_a_conv_step_holds_from_call_2_what_it_held_after_call_1(tmp_path):
    """With glibc's defaults (no MALLOC_ variables), in a fresh process loading the step from
    the disk cache, as bench/memory_table.py measures (VmHWM over VmRSS before the first
    call). Columns allocated in the kernels were mapped on call 1, which raised glibc's mmap
    threshold past them; from call 2 they came from its heap, which kept them: this step at
    batch 128 (3 -> 32 -> 64 channels, 32x32) held 31 MB more from call 2 than after call 1.
    Kept small here, where glibc's rule happened not to show it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env["BACKPLAN_CACHE_DIR"] = str(tmp_path)
    script_facts(_RESIDENT, "warm", env=env)
    facts = script_facts(_RESIDENT, "measure", env=env)
    grown = facts["grown"]
    assert grown[0] > facts["scratch"] > 8 * 2**20  # call 1 held the arena, columns inside it
    assert max(grown[1:]) - grown[0] <= 256 * 1024, grown  # a few pages of Python objects
