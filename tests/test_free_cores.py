"""Threads sized to the free cores: the /proc/stat estimate of what other processes use, the
OpenBLAS thread count lowered and raised back, the launch guard that sets both around a step,
and the library's parallel kernels running their serial code on one thread."""

import os
import subprocess
import sys
import textwrap

import numba
import numpy as np
import pytest

from backplan.codegen.run import free_cores, workspace
from backplan.codegen.run.blas_pool import BlasPool, loaded_openblas

STAT = """cpu  900 0 300 5000 10 0 0 0 0 0
cpu0 {b0} 0 {s0} {i0} 5 0 0 {st0} 0 0
cpu1 {b1} 0 {s1} {i1} 5 0 0 0 0 0
intr 1 2 3
"""


def stat_text(b0=100, s0=50, i0=1000, st0=0, b1=100, s1=50, i1=1000) -> str:
    return STAT.format(b0=b0, s0=s0, i0=i0, st0=st0, b1=b1, s1=s1, i1=i1)


def test_busy_ticks_count_user_system_and_steal_of_the_given_cpus_only():
    assert free_cores.busy_ticks([0], stat_text(b0=100, s0=50, st0=7)) == 157
    assert free_cores.busy_ticks([0, 1], stat_text()) == 300
    assert free_cores.busy_ticks([0, 5], stat_text()) is None  # cpu5 is not listed


@pytest.mark.parametrize(
    "cpus, others, free",
    [(2, 0.0, 2), (2, 0.25, 2), (2, 0.5, 1), (2, 1.9, 1), (2, 3.0, 1), (4, 1.0, 3), (1, 0, 1)],
)
def test_free_count_keeps_a_slack_and_at_least_one_core(cpus, others, free):
    assert free_cores.free_count(cpus, others) == free


class FakeMachine:
    """A /proc/stat file, a wall clock and this process's CPU clock that the test moves."""

    def __init__(self, tmp_path, monkeypatch):
        self.path = tmp_path / "stat"
        self.wall, self.own, self.ticks = 100.0, 10.0, 0
        monkeypatch.setattr(free_cores, "process_cpus", lambda: [0, 1])
        self.write()

    def write(self):
        half = self.ticks // 2
        self.path.write_text(stat_text(b0=half, s0=0, b1=self.ticks - half, s1=0))

    def advance(self, seconds, others_cpus, own_cpus):
        """`seconds` pass with other processes busy on `others_cpus` CPUs and this one on
        `own_cpus`."""
        tick = os.sysconf("SC_CLK_TCK")
        self.wall += seconds
        self.own += own_cpus * seconds
        self.ticks += round((others_cpus + own_cpus) * seconds * tick)
        self.write()


def test_the_sampler_sees_another_process_take_a_core_and_leave(tmp_path, monkeypatch):
    machine = FakeMachine(tmp_path, monkeypatch)
    sampler = free_cores.FreeCores(
        str(machine.path), clock=lambda: machine.wall, cpu_clock=lambda: machine.own
    )
    assert sampler.now() == 2  # no window closed yet: every CPU counts as free
    machine.advance(1.0, others_cpus=0.0, own_cpus=2.0)  # this process alone, on both
    assert sampler.now() == 2
    machine.advance(1.0, others_cpus=1.0, own_cpus=1.0)  # another process takes a core
    assert sampler.now() == 1
    machine.advance(0.1, others_cpus=0.0, own_cpus=2.0)  # inside the window: the last answer
    assert sampler.now() == 1
    machine.advance(1.0, others_cpus=0.0, own_cpus=1.0)  # it left
    assert sampler.now() == 2


def test_without_proc_stat_every_cpu_counts_as_free(tmp_path, monkeypatch):
    monkeypatch.setattr(free_cores, "process_cpus", lambda: [0, 1, 2])
    sampler = free_cores.FreeCores(str(tmp_path / "missing"))
    assert sampler.now() == 3


def test_adapting_can_be_turned_off_and_is_read_once_a_window(tmp_path, monkeypatch):
    machine = FakeMachine(tmp_path, monkeypatch)
    sampler = free_cores.FreeCores(
        str(machine.path), clock=lambda: machine.wall, cpu_clock=lambda: machine.own
    )
    monkeypatch.setattr(free_cores, "FREE_CORES", sampler)
    sampler.now()
    machine.advance(1.0, others_cpus=1.0, own_cpus=1.0)  # another process holds a core
    assert free_cores.free_cores() == 1
    monkeypatch.setenv("BACKPLAN_ADAPT_THREADS", "0")
    assert free_cores.free_cores() == 1  # inside the window: the switch is not read per call
    machine.advance(1.0, others_cpus=1.0, own_cpus=1.0)
    assert free_cores.free_cores() == 2  # the next window: off, every CPU
    monkeypatch.setenv("BACKPLAN_ADAPT_THREADS", "1")
    machine.advance(1.0, others_cpus=1.0, own_cpus=1.0)
    assert free_cores.free_cores() == 2  # on again: a new window's first sample has no rate
    machine.advance(1.0, others_cpus=1.0, own_cpus=1.0)
    assert free_cores.free_cores() == 1


def test_busy_ticks_stops_at_the_first_line_that_is_not_a_cpu():
    text = stat_text(b0=100, s0=50) + "cpu0 999999 0 0 0 0 0 0 0\n"  # after intr: not read
    assert free_cores.busy_ticks([0], text) == 150


def _openblas_controls():
    import backplan.codegen.kernels.blas  # noqa: F401 - loads SciPy's OpenBLAS

    pool = BlasPool()
    pool.limit(1 << 20)  # finds the libraries, changes nothing
    if not pool._libraries:
        pytest.skip("no OpenBLAS loaded in this process")
    return pool


def test_blas_pool_lowers_and_raises_back_to_the_count_it_found():
    pool = _openblas_controls()
    found = pool.counts()
    try:
        pool.limit(1)
        assert pool.counts() == [1] * len(found)
        pool.limit(64)
        assert pool.counts() == found  # never above the count it found
    finally:
        for (setter, *_), count in zip(pool._libraries, found, strict=True):
            setter(count)


def test_blas_pool_takes_a_count_set_by_someone_else_as_its_ceiling():
    pool = _openblas_controls()
    found = pool.counts()
    try:
        if min(found) < 2:
            pytest.skip("OpenBLAS runs one thread here")
        pool.limit(8)  # all free: the counts it found
        for setter, *_ in pool._libraries:
            setter(1)  # the user (threadpoolctl) asks for one thread: it stays one
        pool.limit(1)  # a busy machine
        pool.limit(8)  # free again: back to the user's count, not the one found
        assert pool.counts() == [1] * len(found)
    finally:
        for (setter, *_), count in zip(pool._libraries, found, strict=True):
            setter(count)


def test_loaded_openblas_reads_the_maps_file(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 0 08:01 1 /usr/lib/libscipy_openblas-1.so\n"
        "7f01-7f02 r-xp 0 08:01 2 /usr/lib/libc.so.6\n"
        "7f02-7f03 r--p 0 08:01 1 /usr/lib/libscipy_openblas-1.so\n"
    )
    assert loaded_openblas(str(maps)) == ["/usr/lib/libscipy_openblas-1.so"]
    assert loaded_openblas(str(tmp_path / "none")) == []


class CountingPool:
    def __init__(self):
        self.limits = []

    def limit(self, threads):
        self.limits.append(threads)


def test_the_launch_guard_sizes_blas_and_leaves_numba_as_it_is(monkeypatch):
    pool = CountingPool()
    monkeypatch.setattr(workspace, "BLAS_POOL", pool)
    monkeypatch.setattr(workspace, "free_cores", lambda: 1)
    before = numba.get_num_threads()
    guard = workspace.sized_launch(parallel=True, blas=True)
    with guard:
        assert numba.get_num_threads() == before
    assert pool.limits == [1]
    monkeypatch.setattr(workspace, "free_cores", lambda: 2)
    with guard:
        pass
    assert pool.limits == [1, 2]
    assert workspace.sized_launch(parallel=False, blas=False) is None


def test_only_plans_calling_blas_on_the_calling_thread_size_it():
    from backplan.codegen.run.compiled import BLAS_CALL

    calls = [
        "gemm_at_f32(np.bool_(False), np.bool_(False), np.intp(128)",
        "batched_gemm_f64(False, True, a, b, out)",
        "conv2d_input_grad_gemm(g, w, dx, 1, 1, 1, 1, 1, 1, 1)",
        "attention_forward(512, q, k, v, out, 0.125, False, 1024)",
    ]
    inside_parallel_kernels = [
        "own_gemm_at_par(np.intp(2), 512, np.bool_(True)",
        "attention_backward_par(512, q, k, v, g, dq, dk, dv, 0.125, False, 1024)",
        "own_gemm_at(512, np.bool_(False)",
    ]
    assert all(BLAS_CALL.search(line) for line in calls)
    assert not any(BLAS_CALL.search(line) for line in inside_parallel_kernels)


def test_a_plan_sharing_its_gemm_runs_blas_on_one_thread(monkeypatch):
    """A plan whose large products share rows with the GEMM's helper threads runs its BLAS
    products on one thread whatever the free cores (OpenBLAS's second thread would spin on
    the helper's core after each), and the driver source says which plans those are."""
    from backplan.codegen.run.compiled import SHARED_GEMM

    pool = CountingPool()
    monkeypatch.setattr(workspace, "BLAS_POOL", pool)
    monkeypatch.setattr(workspace, "free_cores", lambda: 2)
    with workspace.sized_launch(parallel=True, blas=True, shares_gemm=True):
        pass
    with workspace.sized_launch(parallel=True, blas=True):
        pass
    assert pool.limits == [1, 2]
    assert SHARED_GEMM.search("own_gemm_at_par(np.intp(2), 512, np.bool_(False)")
    assert SHARED_GEMM.search("own_gemm_par(2, 512, False, True, 1.0, a, b, 0.0, c)")
    assert not SHARED_GEMM.search("own_gemm_at(512, np.bool_(False)")
    assert not SHARED_GEMM.search("own_batched_gemm_par(512, False, True, a, b, out)")


SERIAL_ON_ONE_THREAD = textwrap.dedent(
    """
    import threading
    import numba
    import numpy as np
    from backplan.codegen.jit import start_parallel_runtime
    from backplan.codegen.kernels.rows import softmax_rows_par
    start_parallel_runtime()
    x = np.random.default_rng(0).standard_normal((64, 33)).astype(np.float32)
    expected = np.exp(x - x.max(1, keepdims=True))
    expected /= expected.sum(1, keepdims=True)
    failures = []

    def work():
        numba.set_num_threads(1)
        out = np.empty_like(x)
        for _ in range(300):
            softmax_rows_par(x, out, False)
            if not np.allclose(out, expected, rtol=1e-5, atol=1e-6):
                failures.append(1)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("failures", len(failures))
    """
)


def test_a_parallel_library_kernel_on_one_thread_runs_on_the_caller():
    """Two threads call a prange kernel at once, each at one Numba thread: the kernel's serial
    code runs on each caller. Handed to the workqueue pool instead, two launches at once abort
    the process (the workqueue layer is not thread-safe)."""
    env = {**os.environ, "NUMBA_THREADING_LAYER": "workqueue", "NUMBA_NUM_THREADS": "2"}
    done = subprocess.run(
        [sys.executable, "-c", SERIAL_ON_ONE_THREAD],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "failures 0" in done.stdout


@pytest.mark.parametrize("threads", [1, 2])
def test_the_parallel_own_gemm_on_one_or_two_threads_matches_numpy(threads):
    """gemm_parallel and batched_gemm_parallel: the serial code (one thread) and the blocks."""
    from backplan.codegen.kernels.gemm.parallel import batched_gemm_parallel, gemm_parallel

    if threads > numba.config.NUMBA_NUM_THREADS:
        pytest.skip("Numba runs one thread here")
    rng = np.random.default_rng(threads)
    a = rng.standard_normal((70, 33)).astype(np.float32)
    b = rng.standard_normal((9, 33)).astype(np.float32)
    batch_a = rng.standard_normal((5, 33, 17))
    batch_b = rng.standard_normal((1, 9, 17))
    before = numba.get_num_threads()
    numba.set_num_threads(threads)
    try:
        c = np.full((70, 9), np.nan, np.float32)
        gemm_parallel(2, 512, False, True, 1.0, a, b, 0.0, c)
        batched = np.full((5, 33, 9), np.nan)
        batched_gemm_parallel(256, False, True, batch_a, batch_b, batched)
    finally:
        numba.set_num_threads(before)
    np.testing.assert_allclose(c, a @ b.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(batched, batch_a @ batch_b[0].T, rtol=1e-12)


def test_a_forked_child_sizes_blas_though_the_parent_held_the_pool_lock():
    """A fork while another thread holds the pool's lock leaves the child a fresh lock."""
    from backplan.codegen.run.blas_pool import BLAS_POOL

    if not hasattr(os, "fork"):
        pytest.skip("no fork here")
    with BLAS_POOL._lock:
        pid = os.fork()
        if pid == 0:  # the child: the lock it inherited is held by no thread of its own
            acquired = BLAS_POOL._lock.acquire(timeout=5)
            os._exit(0 if acquired else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
