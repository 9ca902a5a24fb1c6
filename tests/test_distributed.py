"""Data-parallel training over MPI. Bucket planning, explain and the argument checks run in this
process without MPI; everything that moves data runs as `mpiexec -n 2 python <script>` in a
subprocess with a timeout, skipped when the [mpi] extra (mpi4py, an MPI library, mpiexec) is not
installed."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

import backplan as bp
import backplan.distributed as bpd
from backplan.distributed import sharding, world
from backplan.distributed.accumulation import Accumulator
from backplan.distributed.driver_hooks import hook_driver
from backplan.distributed.segments import run_segments, split_plan
from backplan.examples.mlp import init_mlp, mlp_loss, synthetic_classification
from backplan.ir.interpreter import run_plan
from backplan.ir.verify import verify_plan

TIMEOUT_S = 60


def _mpiexec() -> str | None:
    beside_python = Path(sys.executable).parent / "mpiexec"
    return str(beside_python) if beside_python.exists() else shutil.which("mpiexec")


MPIEXEC = _mpiexec()
needs_mpi = pytest.mark.skipif(
    importlib.util.find_spec("mpi4py") is None or MPIEXEC is None,
    reason='needs mpi4py and mpiexec: pip install -e ".[mpi]"',
)

PRELUDE = """
import numpy as np
import backplan as bp
import backplan.distributed as bpd
from backplan.examples.mlp import init_mlp, mlp_loss, synthetic_classification

rank, size = bpd.init()
x, y = synthetic_classification(16, 8, 4)
vg = bp.value_and_grad(mlp_loss)
"""


def run_script(
    tmp_path,
    body: str,
    ranks: int | None = 2,
    backend: str = "reference",
    timeout=TIMEOUT_S,
    driver: str = "inline",
    env: dict | None = None,
    reduction: str = "shared",
) -> subprocess.CompletedProcess:
    """Run PRELUDE + body under mpiexec -n ranks (ranks=None: plain python, one rank).
    timeout: seconds; a script on the compiled backend compiles its drivers on a cold cache.
    driver: BACKPLAN_DRIVER; inline by default, as a driver run as Python while its compiled
    twin builds rounds differently. env: more environment variables. reduction:
    BACKPLAN_DP_REDUCTION ("mpi": MPI's allreduces, started inside the compiled driver)."""
    script = tmp_path / "script.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    command = [sys.executable, str(script)]
    if ranks is not None:
        command = [MPIEXEC, "-n", str(ranks), *command]
    env = dict(
        os.environ,
        BACKPLAN_BACKEND=backend,
        BACKPLAN_DRIVER=driver,
        NUMBA_NUM_THREADS="1",
        BACKPLAN_DP_REDUCTION=reduction,
        **(env or {}),
    )
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path
    )


def assert_ranks_ok(result, ranks: int = 2) -> None:
    detail = f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 0, detail
    for rank in range(ranks):
        assert f"rank {rank} ok" in result.stdout, detail


# ---- several tests' scripts in one mpiexec launch ------------------------------------------------
# Each `mpiexec -n 2` costs ~1.3 CPU s before a script runs (two interpreters importing backplan,
# NumPy and mpi4py, MPI's start). Scripts on the reference backend that leave no state a later
# one would see run one after another in one launch, each in its own namespace, its output in a
# file per rank; each test reads its own script's outputs, so a failure names that test and shows
# that script's traceback on each rank. What a script changes in the environment and in
# backplan's modules' globals (a function or constant patched) is put back after it; a class's
# attributes are not.

ONE_LAUNCH_RUNNER = """
import contextlib, faulthandler, gc, os, sys, traceback
from mpi4py import MPI
import backplan.distributed  # its modules' globals are saved before the first script

def module_globals():
    return {m: dict(vars(module)) for m, module in list(sys.modules.items())
            if m.startswith("backplan") and module is not None}

for name in sys.argv[2:]:
    with open(f"{name}.rank{MPI.COMM_WORLD.rank}.out", "w", buffering=1) as out:
        faulthandler.dump_traceback_later(float(sys.argv[1]), exit=True, file=out)
        saved, patched = dict(os.environ), module_globals()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                with open(f"{name}.py") as source:
                    code = compile(source.read(), f"{name}.py", "exec")
                exec(code, {"__name__": "__main__", "__file__": f"{name}.py"})
            except BaseException:
                traceback.print_exc()
                print("script failed")
            else:
                print("script passed")
            os.environ.clear()
            os.environ.update(saved)
            for m, names in patched.items():
                module = vars(sys.modules[m])
                module.update((k, v) for k, v in names.items() if module.get(k) is not v)
            gc.collect()  # what the script made is let go, as at its process's end
            MPI.COMM_WORLD.Barrier()  # a rank that hangs in the script: the timeout names it
        faulthandler.cancel_dump_traceback_later()
"""


def in_one_launch(body: str, reduction: str = "shared"):
    """Marks a test whose script (PRELUDE + body, two ranks, the reference backend,
    BACKPLAN_DP_REDUCTION=reduction) runs in the launch the `launched` fixture shares."""

    def mark(test):
        test.one_launch = (textwrap.dedent(body), reduction)
        return test

    return mark


_launches: dict = {}  # the scripts' names -> (folder of their outputs, the launch's result)


@pytest.fixture
def launched(request, tmp_path_factory):
    """A callable giving this test's script's result (stdout: each rank's output; returncode 0
    when it passed on both ranks). The first test of this process to ask starts one launch of
    every such script of the session, in the session's order."""
    scripts = {
        item.function.__name__: item.function.one_launch
        for item in request.session.items
        if hasattr(getattr(item, "function", None), "one_launch")
    }
    if tuple(scripts) not in _launches:
        folder = tmp_path_factory.mktemp("one_launch")
        for name, (body, reduction) in scripts.items():
            chosen = f"import os\nos.environ['BACKPLAN_DP_REDUCTION'] = {reduction!r}\n"
            (folder / f"{name}.py").write_text(chosen + PRELUDE + body)
        (folder / "runner.py").write_text(ONE_LAUNCH_RUNNER)
        env = dict(os.environ, BACKPLAN_BACKEND="reference", BACKPLAN_DRIVER="inline")
        env["NUMBA_NUM_THREADS"] = "1"
        command = [MPIEXEC, "-n", "2", sys.executable, "runner.py", str(TIMEOUT_S), *scripts]
        try:
            launch = subprocess.run(
                command,
                capture_output=True,
                text=True,
                timeout=TIMEOUT_S * (len(scripts) + 1),
                env=env,
                cwd=folder,
            )
        except subprocess.TimeoutExpired as expired:
            launch = subprocess.CompletedProcess(command, -1, str(expired.stdout), str(expired))
        _launches[tuple(scripts)] = folder, launch
    folder, launch = _launches[tuple(scripts)]
    return lambda: _script_result(folder, launch, request.function.__name__)


def _last_started(folder) -> str:
    started = sorted(folder.glob("*.rank*.out"), key=lambda path: path.stat().st_mtime_ns)
    return started[-1].name.split(".")[0] if started else "its start"


def _script_result(folder, launch, name: str) -> subprocess.CompletedProcess:
    """One script's outputs in a launch, as if it had run alone."""
    outputs, passed = [], True
    for rank in range(2):
        path = folder / f"{name}.rank{rank}.out"
        text = path.read_text() if path.exists() else ""
        if not text.rstrip().endswith("script passed"):
            passed = False
            if not path.exists():
                text = f"(not started: the launch ended in {_last_started(folder)})\n"
            elif "script failed" not in text:
                text += "(did not finish: it timed out or the launch ended in it)\n"
        outputs.append(f"--- rank {rank}, {name} ---\n{text}")
    stderr = (
        f"the launch in {folder}: return code {launch.returncode}\n"
        f"its stdout:\n{launch.stdout}\nits stderr:\n{launch.stderr}"
    )
    return subprocess.CompletedProcess(launch.args, 0 if passed else 1, "".join(outputs), stderr)


# ---- in this process, no MPI ---------------------------------------------------------------------


def leaf(index, ready, nbytes=8, dtype="f32"):
    return bpd.ExchangedLeaf(index, f"g{index}", (nbytes // 4,), dtype, nbytes, ready, f"s{ready}")


def test_buckets_fill_in_plan_order_one_dtype_each():
    leaves = [leaf(0, 9), leaf(1, 2), leaf(2, 5, nbytes=40), leaf(3, 3, dtype="f64"), leaf(4, 7)]
    buckets = bpd.plan_buckets(leaves, bucket_bytes=16)
    assert [[x.index for x in b.leaves] for b in buckets] == [[1], [3], [2], [4, 0]]
    assert [b.ready_step for b in buckets] == [2, 3, 5, 9]
    assert [b.dtype for b in buckets] == ["f32", "f64", "f32", "f32"]
    assert [b.nbytes for b in buckets] == [8, 8, 40, 16]


def test_explain_lists_buckets_in_the_order_the_plan_finishes_them(monkeypatch):
    params = init_mlp([8, 16, 4])
    x, y = synthetic_classification(16, 8, 4)
    step = bpd.data_parallel(bp.value_and_grad(mlp_loss), bucket_bytes=300)
    report = bpd.explain(step, params, bp.tensor(x), bp.tensor(y), size=2)
    names = [name for row in report.buckets for name in row.leaves]
    assert sorted(names) == sorted(["loss"] + [f"grad['{k}']" for k in params])
    assert len(report.buckets) > 1
    assert all(row.nbytes <= 300 or len(row.leaves) == 1 for row in report.buckets)
    ready = [row.ready_step for row in report.buckets]
    assert ready == sorted(ready) and ready[-1] < report.plan_steps
    assert report.bytes_per_step == 4 + sum(p.numpy().nbytes for p in params.values())
    assert report.bytes_sent_per_step == report.bytes_per_step  # the other rank's buckets
    three = bpd.explain(step, params, bp.tensor(x), bp.tensor(y), size=3)
    assert three.bytes_sent_per_step == 2 * three.bytes_per_step  # each rank reads 2 others'
    text = str(report)
    for row in report.buckets:
        assert row.ready_text in text
    assert "through the node's shared memory" in text and "grad['w0']" in text
    assert "Overlap: none" in text and "read/rank" in text
    monkeypatch.setenv("BACKPLAN_DP_REDUCTION", "mpi")  # MPI's allreduce: what overlaps it
    text = str(bpd.explain(step, params, bp.tensor(x), bp.tensor(y), size=2))
    assert "shared memory" not in text and "sent/rank" in text
    assert "bucket 0" in text and "MPI_Iallreduce" in text


def test_explain_without_mpiexec_previews_two_ranks_and_says_how_to_ask_for_more(monkeypatch):
    """A script run without mpiexec is one rank, which exchanges nothing: the preview shows 2
    ranks and says why, unless size= asks for some number or the world has several."""
    params = init_mlp([8, 16, 4])
    x, y = (bp.tensor(a) for a in synthetic_classification(16, 8, 4))
    step = bpd.data_parallel(bp.value_and_grad(mlp_loss))
    monkeypatch.setattr(world, "_state", {"world": world.World(0, 1)})
    alone = bpd.explain(step, params, x, y)
    assert alone.size == 2 and "N=2" in str(alone)
    said = " ".join(str(alone).split())  # the summary is wrapped
    assert "the only rank (run without mpiexec); pass size=N to preview N ranks" in said
    four = bpd.explain(step, params, x, y, size=4)
    assert four.size == 4 and "N=4" in str(four) and "size=N" not in str(four)
    monkeypatch.setattr(world, "_state", {"world": world.World(0, 3)})
    assert bpd.explain(step, params, x, y).size == 3
    monkeypatch.setattr(world, "_state", {})
    assert "bpd.init() has not run here" in " ".join(str(bpd.explain(step, params, x, y)).split())
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="number of ranks to preview"):
            bpd.explain(step, params, x, y, size=bad)


def test_explain_says_an_accumulating_step_exchanges_once_per_k_calls():
    params = init_mlp([8, 16, 4])
    x, y = synthetic_classification(16, 8, 4)
    step = bpd.data_parallel(bp.value_and_grad(mlp_loss), accumulate=4)
    report = bpd.explain(step, params, bp.tensor(x), bp.tensor(y), size=2)
    assert report.accumulate == 4
    text = " ".join(str(report).split())
    per_call = report.bytes_sent_per_step // 4
    assert "With accumulate=4 the ranks exchange once per 4 calls: the others make no MPI" in text
    assert f"about {per_call:,} B per call" in text
    plain = bpd.explain(bpd.data_parallel(bp.value_and_grad(mlp_loss)), params, x, y, size=2)
    assert "accumulate" not in str(plain)


HOOKABLE = """header
@njit(**JIT_OPTIONS)
def run(v0, scratch, v7, v9, INTS):
    # %3 = exp %0 : f32[4]
    k_a(v0, scratch)
    v7_1d = v7.reshape(-1)
    # %7 = sum %3 : f32[4]
    k_b(scratch, v7_1d)
    # %8 = mul %3, %3 : f32[4]
    bad = k_c(scratch, v9)
    if bad != -1:
        raise IndexError('%8 mul', bad)
    # %9 = neg %8 : f32[4]
    k_d(v9, v9)
    return (scratch,)
"""


def test_the_driver_starts_each_bucket_after_the_last_statement_touching_it():
    """A bucket starts after the last statement naming its buffers or a view of them (v7's
    view v7_1d is written by k_b; v9 is written twice), later calls test the started ones,
    and the return stays last."""
    hooked = hook_driver(HOOKABLE, [["v7"], ["v9"]])
    body = hooked.source.split("def run(")[1].split("\n")
    assert body[0] == "v0, scratch, v7, v9, INTS, dp_table):"
    code = [line.strip() for line in body[1:] if line.strip() and not line.strip().startswith("#")]
    assert code.index("dp_start(dp_table, 0)") == code.index("k_b(scratch, v7_1d)") + 1
    assert code.index("dp_start(dp_table, 1)") == code.index("k_d(v9, v9)") + 1
    assert code[code.index("dp_start(dp_table, 0)") + 1 :].count("dp_progress(dp_table)") == 2
    assert code[-1] == "return (scratch,)"
    assert hooked.calls_after == (2, 0) and hooked.ir_names[0] == (7,)
    assert "from backplan.distributed.driver_mpi import" in hooked.source
    split = HOOKABLE.replace(
        "def run(", "def run_part0(x):\n    pass\n\n@njit(**JIT_OPTIONS)\ndef run("
    )
    assert hook_driver(split, [["v7"]]) is None  # a driver in parts is not hooked


@pytest.mark.parametrize("width", [4, 8])
def test_the_driver_passes_mpi_handles_at_this_mpis_width(width):
    """The bucket start calls MPI_Iallreduce with handles of 4 bytes (MPICH) or 8 (Open MPI,
    pointers), chosen by name in the hooked driver's source, so that a driver compiled for one
    MPI (or in a build process, which loads none) is never called with the other's: here a C
    callback stands in for MPI_Iallreduce and records what it was given."""
    import ctypes

    from backplan.distributed import driver_mpi as dm

    handle = ctypes.c_int32 if width == 4 else ctypes.c_int64
    seen = []
    signature = ctypes.CFUNCTYPE(
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
        handle,
        handle,
        handle,
        ctypes.c_void_p,
    )
    fake = signature(lambda *args: seen.append(args) or 0)
    buffer = np.zeros(3, np.float32)
    table = np.zeros(dm.HEADER + dm.BUCKET_SLOTS, np.int64)
    table[dm.IALLREDUCE_AT] = ctypes.cast(fake, ctypes.c_void_p).value
    comm, op, datatype = (
        (0x44000000, 0x58000003, 0x4C00040A)
        if width == 4
        else (0x7F00_1234_5678, 0x7F00_2222_0000, 0x7F00_0000_4444)
    )
    table[dm.COMM_AT] = comm
    at = dm.HEADER
    table[at + dm.ADDRESS], table[at + dm.COUNT] = buffer.ctypes.data, 3
    table[at + dm.DATATYPE], table[at + dm.OP] = datatype, op  # the bucket's own operation
    getattr(dm, dm.start_function(width))(table, 0)
    assert len(seen) == 1 and seen[0][1] == buffer.ctypes.data and seen[0][2] == 3
    assert seen[0][3:6] == (datatype, op, comm)
    assert table[at + dm.STATE] == dm.STARTED
    source = hook_driver(HOOKABLE, [["v7"]], dm.start_function(width)).source
    assert f"{dm.start_function(width)} as dp_start" in source
    with pytest.raises(OSError, match="handles are 2 bytes"):
        dm.start_function(2)


def test_gradients_of_the_layer_run_last_are_ready_first():
    params = init_mlp([8, 16, 16, 4])
    x, y = synthetic_classification(16, 8, 4)
    step = bpd.data_parallel(bp.value_and_grad(mlp_loss), bucket_bytes=1)
    rows = step.explain(params, bp.tensor(x), bp.tensor(y), size=4).buckets
    order = [row.leaves[0] for row in rows]
    assert order[0] == "loss"
    assert order.index("grad['w2']") < order.index("grad['w1']") < order.index("grad['w0']")


def test_split_plan_runs_the_same_steps_as_the_joint_plan():
    params = init_mlp([8, 16, 16, 4])
    x, y = synthetic_classification(16, 8, 4)
    vg = bp.value_and_grad(mlp_loss)
    bound, entry = vg.lookup((params, bp.tensor(x), bp.tensor(y)), {})
    arrays = [bound.call.leaves[p]._data for p in bound.call.tensor_positions]
    cuts = [
        row.ready_step
        for row in bpd.data_parallel(vg, bucket_bytes=1)
        .explain(params, bp.tensor(x), bp.tensor(y), size=2)
        .buckets
    ]
    segments = split_plan(entry.plan, cuts)
    assert len(segments) == len([c for c in cuts if c < entry.plan.return_step - 1]) + 1
    assert [s.first_step for s in segments[1:]] == [s.last_step + 1 for s in segments[:-1]]
    for segment in segments:
        verify_plan(segment.plan)
    seen = []
    outputs = run_segments(segments, entry.plan, arrays, lambda s, env: seen.append(len(env)))
    expected = run_plan(entry.plan, arrays)
    assert len(seen) == len(segments)
    for got, want in zip(outputs, expected, strict=True):
        np.testing.assert_array_equal(got, want)


def test_shard_splits_the_first_axis_as_evenly_as_it_goes():
    data = np.arange(12).reshape(6, 2)
    parts = [bpd.shard(data, r, 3) for r in range(3)]
    np.testing.assert_array_equal(np.concatenate(parts), data)
    assert bpd.shard(bp.tensor(data), 1, 2).shape == (3, 2)
    uneven = [bpd.shard(data, r, 4) for r in range(4)]  # 2, 2, 1, 1 rows
    assert [len(part) for part in uneven] == [2, 2, 1, 1]
    np.testing.assert_array_equal(np.concatenate(uneven), data)
    with pytest.raises(bpd.DistributedError, match=r"6 rows cannot give each of 7 ranks a row"):
        bpd.shard(data, 0, 7)
    with pytest.raises(bpd.DistributedError, match="0 <= rank < size"):
        bpd.shard(data, 2, 2)


def test_init_without_mpi4py_says_what_to_install(monkeypatch):
    monkeypatch.setattr(world, "_state", {})
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    with pytest.raises(bpd.MPIUnavailableError, match=r'pip install -e "\.\[mpi\]"'):
        bpd.init()


@pytest.mark.reference
def test_wait_for_driver_with_arguments_never_called_traces_nothing():
    """It only asks: a trace at another batch size made the axis dynamic and replaced the
    entry whose hooked driver was built, so the next step built it again (12 s on 2 ranks)."""
    x, labels = synthetic_classification(16, 8, 3)
    params = init_mlp([8, 4, 3], seed=0)
    step = bpd.data_parallel(bp.value_and_grad(mlp_loss))
    step(params, x, labels)
    assert step.fn.cache_info().traces == 1
    assert step.wait_for_driver(params, x[:5], labels[:5], timeout=0) is False
    assert step.fn.cache_info().traces == 1 and step.fn.cache_info().entries == 1


def test_the_bench_pairs_the_ranks_calls_and_measures_the_step_against_the_slower_plan():
    """bench.data_parallel's report: per call, the plan of the rank that took longest, and the
    step beyond it; rank 1's plans are the slower ones in calls 0 and 2, rank 0's in call 1."""
    from backplan.bench.data_parallel import slower_rank_text

    class Gathered:  # comm.gather(records, root=0) on rank 0 of 2
        def gather(self, records, root):
            rank1 = [(0.010, 0.008, 0.004), (0.012, 0.005, 0.004), (0.011, 0.009, 0.005)]
            return [records, rank1]

    rank0 = [(0.010, 0.004, 0.004), (0.012, 0.010, 0.004), (0.011, 0.004, 0.004)]
    said = slower_rank_text(rank0, Gathered())
    # slower plans 8, 10, 9 ms against steps 10, 12, 11: 2 ms beyond it in every call
    assert "step 11.00 ms, the slower rank's plan 9.00 ms, step - slower plan 2.00 ms" in said
    assert "slower plan / step 0.82" in said
    assert "rank 0 4.00 / 4.00, rank 1 8.00 / 4.00" in said


def test_the_bench_says_where_the_step_cpu_goes():
    """bench.data_parallel's CPU breakdown of rank 0's step: plan, agreement, bucket waits,
    finish beyond its waits, and the rest (step less all of them), means over calls (so that
    the parts add up to the step)."""
    from backplan.bench.data_parallel import cpu_parts_text

    # (wall, plan wall, plan CPU, step CPU, agreement, bucket waits, finish less its waits,
    # packing, the node's sums: both 0 where MPI sums)
    records = [(0.0, 0.0, 0.0025, 0.0040, 0.0004, 0.0006, 0.0002, 0.0, 0.0)] * 2
    records.append((0.0, 0.0, 0.0028, 0.0070, 0.0010, 0.0027, 0.0002, 0.0, 0.0))
    said = cpu_parts_text(records, 0.0021)
    assert "step 5.00 ms = plan inside the step 2.60 (compute alone 2.10)" in said, said
    assert "agreement 0.60 + the bucket waits 1.30 + averaging and unpacking 0.20" in said
    assert "the rest 0.30" in said and "(means of 3 calls)" in said
    assert "+ packing" not in said
    shared = [r[:7] + (0.0001, 0.0002) for r in records]  # summed in the node's window
    said = cpu_parts_text(shared, 0.0021)
    assert "the bucket waits 1.30 + packing 0.10 + the node's sums 0.20 + averaging" in said, said
    assert "the rest 0.00" in said or "the rest -0.00" in said  # 0.30 less 0.10 + 0.20


def test_data_parallel_needs_value_and_grad():
    for not_value_and_grad in (mlp_loss, bp.grad(mlp_loss)):
        with pytest.raises(TypeError, match=r"bp\.value_and_grad\(loss_fn\)"):
            bpd.data_parallel(not_value_and_grad)
    with pytest.raises(ValueError, match="bucket_bytes"):
        bpd.data_parallel(bp.value_and_grad(mlp_loss), bucket_bytes=0)
    for timeout in (0, -1.0, float("nan"), float("inf"), "5"):
        with pytest.raises(ValueError, match="timeout must be positive seconds or None"):
            bpd.data_parallel(bp.value_and_grad(mlp_loss), timeout=timeout)


# ---- under mpiexec -------------------------------------------------------------------------------


@needs_mpi
@in_one_launch(
    """
        params = bpd.broadcast(init_mlp([8, 16, 4], seed=rank))  # rank 0's weights everywhere
        step = bpd.data_parallel(vg, check_replicas=True, bucket_bytes=300)
        xs, ys = bpd.shard(x, rank, size), bpd.shard(y, rank, size)
        loss, grads = step(params, xs, ys)
        full_loss, full = vg(params, x, y)
        np.testing.assert_allclose(loss.item(), full_loss.item(), rtol=1e-6)
        for name in params:
            np.testing.assert_allclose(grads[name].numpy(), full[name].numpy(), rtol=1e-5,
                                       atol=1e-7)
        split_loss, split = bpd.data_parallel(vg, bucket_bytes=300, split_plan=True)(
            params, xs, ys
        )
        assert split_loss.item() == loss.item()
        assert all((split[k].numpy() == grads[k].numpy()).all() for k in params)
        summed = bpd.data_parallel(vg, average=False)(params, xs, ys)[1]
        np.testing.assert_allclose(summed["w0"].numpy(), 2 * grads["w0"].numpy(), rtol=1e-6)
        with_aux = bp.value_and_grad(lambda p, a, b: (mlp_loss(p, a, b), a.sum()), has_aux=True)
        (aux_loss, aux), aux_grads = bpd.data_parallel(with_aux)(params, xs, ys)
        assert np.isclose(aux.item(), xs.sum(), rtol=1e-5)  # aux stays this rank's own
        assert aux_loss.item() == loss.item() and set(aux_grads) == set(params)
        for _ in range(3):
            loss, grads = step(params, xs, ys)
            params = {k: bp.tensor(p.numpy() - 0.1 * grads[k].numpy(), requires_grad=True)
                      for k, p in params.items()}
        bpd.check_replicas(params)
        if rank == 1:
            params["b0"] = bp.tensor(params["b0"].numpy() + 1e-3, requires_grad=True)
        try:
            step(params, xs, ys)
        except bpd.ReplicaMismatchError as error:
            assert "leaf ['b0'] differs between rank 0 and rank 1" in str(error), error
        else:
            raise AssertionError("drifted replicas went unnoticed")
        report = step.explain(params, xs, ys)
        if rank == 0:
            print(report)
        print(f"rank {rank} ok")
        """,
)
def test_two_ranks_average_to_the_full_batch_and_stay_identical(launched):
    result = launched()
    assert_ranks_ok(result)
    assert "bucket" in result.stdout and "grad['w0']" in result.stdout
    assert "on 2 ranks" in result.stdout


@needs_mpi
def test_the_compiled_step_starts_buckets_itself_and_equals_the_step_after_the_call(tmp_path):
    """On the compiled backend the driver writes the gradients into the bucket buffers and
    starts each allreduce inside the call: the same bits as starting them after the call
    (overlap=False), a returned gradient is not changed by the next step, explain says where
    each starts; unequal shards and the unsharded optimizer take the same path bit for bit."""
    result = run_script(
        tmp_path,
        """
        params = bpd.broadcast(init_mlp([8, 16, 4], seed=rank))
        xs, ys = bpd.shard(x, rank, size), bpd.shard(y, rank, size)
        inside = bpd.data_parallel(vg, bucket_bytes=300)
        after = bpd.data_parallel(vg, bucket_bytes=300, overlap=False)
        report = inside.explain(params, xs, ys)
        assert all(row.calls_in_flight is not None for row in report.buckets), str(report)
        assert "inside the call" in str(report)
        assert "inside the call" not in str(after.explain(params, xs, ys))
        full_loss, full = vg(params, x, y)  # one process, the whole batch
        for _ in range(2):
            loss, grads = inside(params, xs, ys)
            loss_after, grads_after = after(params, xs, ys)
            if full is not None:
                np.testing.assert_allclose(loss.item(), full_loss.item(), rtol=1e-6)
                for k in params:
                    np.testing.assert_allclose(grads[k].numpy(), full[k].numpy(), rtol=1e-5,
                                               atol=1e-7)
                full = None
            assert loss.item() == loss_after.item()
            for k in params:
                assert (grads[k].numpy() == grads_after[k].numpy()).all(), k
            params = {k: p - 0.1 * grads[k] for k, p in params.items()}
        l1, g1 = inside(params, xs, ys)
        before = {k: g.numpy().copy() for k, g in g1.items()}
        inside({k: p * 2 for k, p in params.items()}, xs, ys)
        assert all((before[k] == g1[k].numpy()).all() for k in params)
        l3, g3 = inside(params, xs, ys)
        address = g3["w0"].numpy().ctypes.data
        del l3, g3
        l2, g2 = inside(params, xs, ys)  # nothing holds the last buckets: written again
        assert g2["w0"].numpy().ctypes.data == address
        assert all((before[k] == g2[k].numpy()).all() for k in params)
        timed = bpd.data_parallel(vg, bucket_bytes=300, timeout=30)  # waits by MPI_Test
        l4, g4 = timed(params, xs, ys)
        assert l4.item() == l2.item() and all((before[k] == g4[k].numpy()).all() for k in params)
        opt = bp.optim.sgd(0.1, momentum=0.9)
        t_in = bpd.data_parallel(vg, optimizer=opt, bucket_bytes=300)
        t_af = bpd.data_parallel(vg, optimizer=opt, bucket_bytes=300, overlap=False)
        p_in, s_in = params, t_in.init(params)
        p_af, s_af = params, t_af.init(params)
        for _ in range(2):
            p_in, s_in, _ = t_in(p_in, s_in, xs, ys)
            p_af, s_af, _ = t_af(p_af, s_af, xs, ys)
        assert all((p_in[k].numpy() == p_af[k].numpy()).all() for k in params)
        zero = bpd.data_parallel(vg, optimizer=opt, bucket_bytes=300, shard_optimizer=True)
        assert "inside the call" not in str(zero.explain(params, zero.init(params), xs, ys))
        n = 3 if rank == 0 else 13  # unequal shards: scaled before the sum, after the call
        l_in, g_in = inside(params, x[:n], y[:n])
        l_af, g_af = after(params, x[:n], y[:n])
        assert l_in.item() == l_af.item()
        assert all((g_in[k].numpy() == g_af[k].numpy()).all() for k in params)
        # b's gradient is a literal (3), no output buffer: its bucket starts after the call,
        # after w's bucket, which the driver started; every rank keeps that order
        mixed = bp.value_and_grad(lambda p, a: bp.sum(bp.relu(a @ p["w"])) + p["b"] * 3.0)
        mp = {"w": params["w0"], "b": bp.tensor(np.float32(1.0), requires_grad=True)}
        m_in = bpd.data_parallel(mixed, bucket_bytes=16)
        started = [row.calls_in_flight is not None for row in m_in.explain(mp, xs).buckets]
        assert started == [False, True], started
        (l_in, g_in), (l_af, g_af) = m_in(mp, xs), bpd.data_parallel(mixed, overlap=False)(mp, xs)
        assert l_in.item() == l_af.item() and g_in["b"].item() == 3.0
        assert (g_in["w"].numpy() == g_af["w"].numpy()).all()
        print(f"rank {rank} ok")
        """,
        backend="numba",
        timeout=600,
        reduction="mpi",  # the compiled driver starts MPI's allreduces
    )
    assert_ranks_ok(result)


@needs_mpi
def test_under_background_drivers_a_big_plan_still_starts_its_buckets_inside(tmp_path):
    """BACKPLAN_DRIVER=background (the default) keeps a big plan's own driver Python (compiled
    it would save under 5% of a step), but the step's driver with the allreduces inside is
    built in a background process: the first calls start the buckets after the call (explain
    says so), then, once it is loaded, inside; the same values as overlap=False within the
    rounding of a Python-run driver against a compiled one. overlap=False, which runs the plan's
    own driver, asks for that one compiled in the background."""
    result = run_script(
        tmp_path,
        """
        from backplan.distributed.exchange import Exchange

        params = bpd.broadcast(init_mlp([64, 512, 512, 4], seed=rank))
        bx, by = synthetic_classification(1024, 64, 4)
        xs, ys = bpd.shard(bx, rank, size), bpd.shard(by, rank, size)
        inside = bpd.data_parallel(vg)
        after = bpd.data_parallel(vg, overlap=False)
        loss, grads = inside(params, xs, ys)
        compiled = vg.lookup((params, xs, ys), {})[1].runner().compiled
        assert compiled.driver_skipped and compiled.driver_tier == "python", compiled.driver_tier
        assert "inside the call" in str(inside.explain(params, xs, ys))
        assert inside.wait_for_driver(params, xs, ys, timeout=400)
        assert "in a background process" not in str(inside.explain(params, xs, ys))
        exchange = inside.started((params, xs, ys), {}, Exchange)[0]
        kinds = {type(request).__name__ for _, _, request in exchange.started}
        exchange.finish()
        assert kinds == {"TableRequest"}, kinds
        assert not after.wait_for_driver(params, xs, ys)
        for _ in range(2):
            (loss, grads), (loss_after, grads_after) = inside(params, xs, ys), after(params, xs, ys)
            np.testing.assert_allclose(loss.item(), loss_after.item(), rtol=1e-6)
            for k in params:
                np.testing.assert_allclose(grads[k].numpy(), grads_after[k].numpy(), rtol=1e-4,
                                           atol=1e-6)
            params = {k: p - 0.1 * grads[k] for k, p in params.items()}
        # overlap=False runs the plan's own driver, which background mode kept Python: the step
        # asked for it compiled (every rank waits for the slowest plan), as the overlapped is
        assert not after.wait_for_driver(params, xs, ys, timeout=400)
        assert compiled.driver_tier == "compiled" and compiled.driver_skipped is None
        print(f"rank {rank} ok")
        """,
        backend="numba",
        timeout=600,
        driver="background",
        # a cache folder of its own: a plan's driver compiled once (by this test) is found
        # compiled in the shared one, and the plan's driver would not be Python to begin with
        env={"BACKPLAN_CACHE_DIR": str(tmp_path / "cache")},
        reduction="mpi",  # the compiled driver starts MPI's allreduces
    )
    assert_ranks_ok(result)


@needs_mpi
@in_one_launch(
    """
        import ml_dtypes
        for half in (ml_dtypes.bfloat16, np.float16):
            start = {k: bp.tensor(v.numpy().astype(half), requires_grad=True)
                     for k, v in init_mlp([8, 15, 4], seed=rank).items()}
            params = bpd.broadcast(start)
            bpd.check_replicas(params)
            assert params["w0"].numpy().dtype == half
            x16 = x.astype(half)
            rows = (slice(0, 4), slice(4, 7))[rank]
            full_loss, full = vg(params, x16[:7], y[:7])
            loss, grads = bpd.data_parallel(vg, bucket_bytes=300)(params, x16[rows], y[rows])
            tolerance = 2 ** -6 if half is ml_dtypes.bfloat16 else 2 ** -9
            np.testing.assert_allclose(float(loss.item()), float(full_loss.item()),
                                       rtol=tolerance)
            for k in params:
                assert grads[k].numpy().dtype == half, (k, grads[k].numpy().dtype)
                got, want = (a.numpy().astype(np.float32) for a in (grads[k], full[k]))
                np.testing.assert_allclose(got, want, rtol=4 * tolerance,
                                           atol=4 * tolerance * np.abs(want).max())
            xs, ys = bpd.shard(x16, rank, size), bpd.shard(y, rank, size)
            opt = bp.optim.adam(0.01, master_dtype=bp.float32)
            stepped = {}
            for shard in (False, True):
                train = bpd.data_parallel(vg, optimizer=opt, shard_optimizer=shard)
                p, state = params, train.init(params)
                for _ in range(2):
                    p, state, loss = train(p, state, xs, ys)
                stepped[shard] = p, loss.item()
            report = train.explain(p, state, xs, ys)  # the sharded step's: what it posts
            posted = [b for k, b in train._buffers.items() if k[0] == "send"]
            posted += [b[0] for k, b in train._buffers.items() if k[0] == "gathered"]
            assert posted[0].dtype == np.float32 and posted[-1].dtype == half
            assert report.bytes_sent_per_step == sum(
                b.nbytes * (size - 1) // size for b in posted
            ), (report.bytes_sent_per_step, [(b.nbytes, b.dtype) for b in posted])
            assert stepped[True][1] == stepped[False][1]
            for k in params:
                assert stepped[True][0][k].numpy().dtype == half
                assert (stepped[True][0][k].numpy() == stepped[False][0][k].numpy()).all(), k
            bpd.check_replicas(stepped[True][0])
        print(f"rank {rank} ok")
        """,
    reduction="mpi",  # reads the MPI send buffers' bytes
)
def test_16_bit_parameters_broadcast_sum_and_shard(launched):
    """bfloat16 and float16 parameters: mpi4py takes no bfloat16 and MPI sums no 16-bit float,
    so every 16-bit gradient bucket failed in its allreduce (BufferError: DLPack only supports
    ... float and complex dtypes) and ZeRO-1 lost bfloat16 in its layout ('dtype |V2 is not
    supported'). Broadcast and all-gather move the bits, sums run in float32 and are rounded
    once: the gradients keep their dtype and follow the one-process step on the whole batch;
    ZeRO-1 gives the unsharded step's bytes. Unequal rows (4 and 3) on the plain step."""
    result = launched()
    assert_ranks_ok(result)


@needs_mpi
@in_one_launch(
    """
        import ml_dtypes
        from mpi4py import MPI
        from backplan.distributed import exchange
        sent, op = exchange.sent_in_16_bits, exchange.half_op
        ops = []
        exchange.half_op = lambda dtype, average: ops.append(average) or op(dtype, average)

        def run(params, xs, ys, average, rows, wide=False):
            exchange.sent_in_16_bits = (lambda *a, **k: False) if wide else sent
            step = bpd.data_parallel(vg, bucket_bytes=300, average=average)
            loss, grads = step(params, xs[rows], ys[rows])
            return loss, {k: g.numpy() for k, g in grads.items()}, step

        for half in (ml_dtypes.bfloat16, np.float16):
            params = bpd.broadcast({k: bp.tensor(v.numpy().astype(half), requires_grad=True)
                                    for k, v in init_mlp([8, 15, 4], seed=5).items()})
            xs = bpd.shard(x.astype(half) * (1 + 3 * rank), rank, size)
            ys = bpd.shard(y, rank, size)
            for average in (True, False):
                for rows in (slice(None), slice(0, 3 + rank)):  # equal, then unequal rows
                    ops.clear()
                    loss, got, step = run(params, xs, ys, average, rows)
                    report = step.explain(params, xs, ys)
                    scaled = average and rows != slice(None)  # a mean weighted by rows
                    assert ops == ([] if scaled else [average] * len(report.buckets)), ops
                    loss_wide, want, _ = run(params, xs, ys, average, rows, wide=True)
                    assert loss.item() == loss_wide.item()
                    for k in params:
                        assert got[k].dtype == half
                        same = got[k].view(np.uint16) == want[k].view(np.uint16)
                        assert same.all(), (half, k, average, rows)
            assert len({b.dtype for b in report.buckets}) == 1  # the loss too is 16-bit
            assert report.bytes_sent_per_step == sum(b.nbytes for b in report.buckets)
            values = [np.nan, np.inf, -np.inf, 3e38, 6e4, 1e-40, 3e-8, 1.0 + rank / 128, -2.5e-3]
            values = np.array(values, np.float32).astype(half)
            both = MPI.COMM_WORLD.allgather(values)
            with np.errstate(all="ignore"):
                total = both[0].astype(np.float32) + both[1].astype(np.float32)
                for average in (False, True):
                    buffer = values.copy()
                    wire = [buffer.view(np.uint16), MPI.UINT16_T]
                    dtype = "bf16" if half is ml_dtypes.bfloat16 else "f16"
                    MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, wire, op=op(dtype, average))
                    want = (total * np.float32(0.5 if average else 1.0)).astype(half)
                    got = buffer.astype(np.float32)
                    nan = np.isnan(got) & np.isnan(want.astype(np.float32))
                    same = (buffer.view(np.uint16) == want.view(np.uint16)) | nan
                    assert same.all(), (half, average, buffer, want)
        print(f"rank {rank} ok")
        """,
    reduction="mpi",  # the compiled driver starts MPI's allreduces
)
def test_16_bit_buckets_travel_in_16_bits_on_two_ranks_with_the_float32_sums_bits(launched):
    """bfloat16 and float16 gradients were widened to float32 for the allreduce (twice the
    bytes on the wire). On two ranks each element is combined once, so an MPI operation adding
    in float32, halving when averaging and rounding once sends 16 bits and gives the float32
    path's bits: checked against that path (forced here), averaged and summed; a mean over
    unequal rows (scaled before the sum) keeps float32 on the wire; explain counts the bytes
    sent. The operations alone: NaN, infinities, float16 overflow (a mean stays finite),
    subnormals."""
    assert_ranks_ok(launched())


def test_float16_widening_and_rounding_match_numpy_to_the_bit():
    """half_sum's float16 conversions, which its MPI operation runs: every float16 widened to
    float32 exactly; float32 values rounded to float16 to nearest even as NumPy does (normals,
    subnormals, ties between neighbours, overflow to inf, NaN)."""
    from backplan.distributed.half_sum import _round_float16, _widen_float16

    every = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    words = np.empty(every.size, np.uint32)
    _widen_float16(every, words)
    want = every.view(np.float16).astype(np.float32)
    got = words.view(np.float32)
    assert ((got == want) | (np.isnan(got) & np.isnan(want))).all()
    assert ((words >> 31) == (every >> 15)).all()  # signs, of NaN and zero too
    rng = np.random.default_rng(0)
    finite = want[np.isfinite(want)].astype(np.float64)
    finite.sort()
    ties = ((finite[:-1] + finite[1:]) / 2).astype(np.float32)  # exact: 11 of 24 bits
    scattered = rng.standard_normal(200_000) * 2.0 ** rng.integers(-30, 18, 200_000)
    edges = [65504, 65519.99, 65520, 65536, 3e38, np.inf, -np.inf, np.nan, 2.98e-8, 1e-45, -0.0]
    values = np.concatenate([want, ties, scattered.astype(np.float32), np.float32(edges)])
    halves = np.empty(values.size, np.uint16)
    _round_float16(values.view(np.uint32).copy(), halves)
    with np.errstate(over="ignore"):
        expected = values.astype(np.float16)
    nan = np.isnan(expected) & np.isnan(halves.view(np.float16))
    assert ((halves == expected.view(np.uint16)) | nan).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_node_sum_adds_and_averages_in_one_pass_to_numpys_bits(dtype):
    """node_sum.sum_into (each rank's sum of a bucket over the window's buffers) gives the bits
    of NumPy's rank-order additions followed by rows.average_in_place, on 2 to 5 ranks, summed
    and averaged, NaN, infinities, overflow, subnormals and signed zeros included (float32 on a
    power of two ranks: a product with 1/N; on 3 and 5: a division), odd lengths, empty."""
    from backplan.distributed.node_sum import sum_into
    from backplan.distributed.rows import average_in_place

    rng = np.random.default_rng(7)
    edges = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, 1e-39, -1e-40, 3e38, -3e38, 1e-310]
    bits = np.uint32 if dtype is np.float32 else np.uint64
    for size in (2, 3, 4, 5):
        for n in (0, 1, 17, 1003):
            buffers = []
            for _ in range(size):
                x = rng.standard_normal(n) * 10.0 ** rng.integers(-40, 38, n)
                x[: min(n, len(edges))] = rng.permutation(edges)[: min(n, len(edges))]
                buffers.append(x.astype(dtype))
            for average in (False, True):
                with np.errstate(all="ignore"):
                    want = np.add(buffers[0], buffers[1])
                    for x in buffers[2:]:
                        want += x
                    if average:
                        average_in_place(want, size)
                    got = np.full(n, 12345, dtype)
                    sum_into(buffers, got, average)
                assert (got.view(bits) == want.view(bits)).all(), (size, n, average)
            assert n < 2 or not (got == buffers[0]).all()  # it did write


@pytest.mark.parametrize("half", ["bf16", "f16"])
def test_the_node_sum_of_16_bit_buckets_widens_as_it_adds_to_the_float32_sums_bits(half):
    """node_sum.sum_widened_into (the node's sum of a 16-bit bucket held as bit patterns in the
    window) gives the bits of widening every rank's values to float32, scaling each by its
    rank's weight (rows.scale_by_weight, 0 for a rank of 0 rows), adding them in rank order and
    averaging (rows.average_in_place), on 2 to 4 ranks, every 16-bit pattern (NaN, infinities,
    subnormals) at random; where two ranks both hold a NaN only NaN-ness is compared (which
    payload an addition of two NaNs keeps is the compiled loop's operand order). Summed in
    place (sum_widened_in_place: a rank's part of a big bucket), that sum rounded once to the
    16-bit dtype, written over the rank's own buffer only (a NaN's payload is the rounding's:
    ml_dtypes makes every NaN its canonical one, the window's rounding keeps the payload, as
    the 16-bit MPI operation does)."""
    from backplan.distributed.node_sum import sum_widened_in_place, sum_widened_into
    from backplan.distributed.rows import average_in_place, scale_by_weight
    from backplan.ir.types import np_dtype

    dtype = np_dtype(half)
    rng = np.random.default_rng(11)
    for size in (2, 3, 4):
        for n in (0, 1, 4097, 9001):  # across the widening's 4096-element chunks
            bits = [rng.integers(0, 1 << 16, n, dtype=np.uint16) for _ in range(size)]
            cases = [(None, False), (None, True), ([0.0] + [1 / (size - 1)] * (size - 1), False)]
            cases.append(([0.25, 0.75] + [0.0] * (size - 2), False))
            for weights, average in cases:
                wide = [b.view(dtype).astype(np.float32) for b in bits]
                with np.errstate(all="ignore"):
                    if weights is not None:
                        for w, values in zip(weights, wide, strict=True):
                            scale_by_weight(values, w)
                    want = np.add(wide[0], wide[1])
                    for values in wide[2:]:
                        want += values
                    if average:
                        average_in_place(want, size)
                got = np.full(n, 3.0, np.float32)
                sum_widened_into(bits, got, half, average, weights)
                nan = np.isnan(got) & np.isnan(want)
                same = (got.view(np.uint32) == want.view(np.uint32)) | nan
                assert same.all(), (size, n, weights, average, got[~same][:4], want[~same][:4])
                several = sum(np.isnan(w) for w in wide) > 1  # NaN + NaN: payload unspecified
                assert (got.view(np.uint32) == want.view(np.uint32))[~several].all()
                with np.errstate(all="ignore"):
                    rounded = want.astype(dtype).view(np.uint16)  # rounded once, as unpacked
                for rank in range(size):  # summed in place (two ranks: its own loops)
                    mine = [b.copy() for b in bits]
                    sum_widened_in_place(mine, rank, half, average, weights)
                    nan = np.isnan(rounded.view(dtype))  # NaN-ness only: payloads unspecified
                    assert (np.isnan(mine[rank].view(dtype)) == nan).all(), (size, n, rank)
                    assert (mine[rank] == rounded)[~nan].all(), (size, n, rank, weights)
                    assert all((m == bits[q]).all() for q, m in enumerate(mine) if q != rank)


@needs_mpi
def test_the_compiled_step_starts_16_bit_buckets_itself_on_two_ranks(tmp_path):
    """On two ranks a bfloat16 or float16 bucket is summed by the step's own MPI operation, so
    the compiled driver starts it inside the call like a float32 one (the backward writes the
    gradients into it: no pack copy); they were all started after the call. The same bits as
    overlap=False, averaged and summed; explain says where each starts."""
    result = run_script(
        tmp_path,
        """
        import ml_dtypes
        from backplan.distributed.in_plan import InPlanExchange
        run, inside = InPlanExchange.run, []
        InPlanExchange.run = lambda self, *args: inside.append(1) or run(self, *args)
        # bfloat16 alone: float16 takes the same path but for its operation (tested above);
        # a second plan would add its cold compile to the suite
        for half, average in ((ml_dtypes.bfloat16, True), (ml_dtypes.bfloat16, False)):
            params = bpd.broadcast({k: bp.tensor(v.numpy().astype(half), requires_grad=True)
                                    for k, v in init_mlp([8, 16, 4], seed=2).items()})
            xs = bpd.shard(x.astype(half) * (1 + rank), rank, size)
            ys = bpd.shard(y, rank, size)
            step = bpd.data_parallel(vg, bucket_bytes=300, average=average)
            after = bpd.data_parallel(vg, bucket_bytes=300, average=average, overlap=False)
            report = step.explain(params, xs, ys)
            assert len({row.dtype for row in report.buckets}) == 1  # the loss too is 16-bit
            assert all(row.calls_in_flight is not None for row in report.buckets), str(report)
            inside.clear()
            for _ in range(2):
                loss, grads = step(params, xs, ys)
                loss_after, grads_after = after(params, xs, ys)
                assert loss.item() == loss_after.item()
                for k in params:
                    assert grads[k].numpy().dtype == half
                    bits = grads[k].numpy().view(np.uint16)
                    assert (bits == grads_after[k].numpy().view(np.uint16)).all(), (k, average)
            assert len(inside) == 2, inside
        print(f"rank {rank} ok")
        """,
        backend="numba",
        timeout=600,
        reduction="mpi",  # the compiled driver starts MPI's allreduces
    )
    assert_ranks_ok(result)


@needs_mpi
@in_one_launch(
    """
        params = bpd.broadcast(init_mlp([8, 16, 4], seed=rank))
        x7, y7 = x[:7], y[:7]
        rows = (slice(0, 4), slice(4, 7))[rank]  # as bpd.shard(x7, rank, size) splits them
        xs, ys = x7[rows], y7[rows]
        full_loss, full = vg(params, x7, y7)
        for split in (False, True):
            loss, grads = bpd.data_parallel(vg, bucket_bytes=300, split_plan=split)(
                params, xs, ys
            )
            np.testing.assert_allclose(loss.item(), full_loss.item(), rtol=1e-6)
            for name in params:
                np.testing.assert_allclose(grads[name].numpy(), full[name].numpy(), rtol=1e-5,
                                           atol=1e-7)
        first_rows = bp.value_and_grad(lambda p, a, b: mlp_loss(p, a, b[: len(a)]))
        try:
            bpd.data_parallel(first_rows)(params, xs, y[: 5 + rank])  # 4 and 5, 3 and 6 rows
        except bpd.RankMismatchError as error:
            assert "rank 0's batch arguments disagree" in str(error), str(error)
            assert "argument 1: 4 rows, argument 2: 5 rows" in str(error), str(error)
        else:
            raise AssertionError("batch arguments of different rows went unnoticed")
        print(f"rank {rank} ok")
        """,
)
def test_unequal_shards_weight_each_rank_by_its_rows(launched):
    """7 rows on 2 ranks are 4 and 3: the mean of the two ranks' means is not the batch's mean
    (it differed by 8e-2); weighted by rows it is, in both step modes. Batch arguments that
    disagree about a rank's rows are refused on every rank."""
    result = launched()
    assert_ranks_ok(result)


@needs_mpi
def test_explain_says_when_each_node_sum_runs_as_the_step_runs_it(tmp_path):
    """explain's table on one node says each bucket's sum starts when the call returns (s{N})
    and is waited on before step() returns, in bucket order, each rank reading the other's
    bucket bytes: the compiled step's calls (numba backend, the plan writing into the window)
    run the plan, then sum each bucket in that order, from buffers of those bytes."""
    result = run_script(
        tmp_path,
        """
        from backplan.distributed import shared_exchange
        from backplan.distributed.shared_exchange import SharedRequest, WindowOutputs
        events = []
        run, summed = WindowOutputs.run, SharedRequest._sum
        def running(self, *a):
            out = run(self, *a)
            events.append(("plan returned", out is not None))
            return out
        def summing(self):
            other = self.window.buffer(1 - rank, self.index, self.parity)
            events.append(("sum", self.index, other.nbytes))
            return summed(self)
        WindowOutputs.run, SharedRequest._sum = running, summing
        params = bpd.broadcast(init_mlp([8, 16, 4], seed=rank))
        xs, ys = bpd.shard(x, rank, size), bpd.shard(y, rank, size)
        step = bpd.data_parallel(vg, bucket_bytes=300)
        report = bpd.explain(step, params, xs, ys)
        for _ in range(3):
            step(params, xs, ys)
        text = str(report)
        assert f"s{report.plan_steps} (call returns)" in text, text
        rows = report.buckets
        assert len(rows) > 1 and all(row.start_step == report.plan_steps for row in rows)
        assert all(row.calls_in_flight is None for row in rows)  # none inside the call
        expected = [("plan returned", True)] + [("sum", r.index, r.bytes_sent) for r in rows]
        assert events[-len(expected):] == expected, (events, expected)  # the third call
        assert events[-2 * len(expected):-len(expected)] == expected, events  # the second
        print(f"rank {rank} ok")
        """,
        backend="numba",
        timeout=300,
    )
    assert_ranks_ok(result)


@needs_mpi
@in_one_launch(
    """
        import time
        from backplan.distributed import futex, node_window
        from backplan.distributed.node_window import READY, NodeWindow
        from backplan.distributed.world import current_world
        assert futex.available
        node_window.SLEEP_S = 30.0
        woken = []
        wake = futex.wake
        futex.wake = lambda address: woken.append(address) or wake(address)
        comm = current_world().comm
        w = NodeWindow(comm, [4, 4], [np.dtype(np.float32)] * 2, 30, "the test's window")
        comm.Barrier()
        if rank == 1:
            time.sleep(0.5)  # rank 0 sleeps on bucket 0's counter by then
            w.mark(READY, 0, 1)
            assert len(woken) == 1, woken
        else:
            w.mark(READY, 0, 1)  # its own first, as a step does: rank 1 is not waiting
            start = time.perf_counter()
            assert w.wait_at(READY, 0, 1, seconds=60)
            assert time.perf_counter() - start < 20  # woken by the mark, not the 30 s limit
            assert w._sleepers[1].tobytes() == bytes(64)  # its byte lowered again
        comm.Barrier()
        w.mark(READY, 1, 1)  # nobody sleeps: no wake-up call
        comm.Barrier()
        assert w.wait_at(READY, 1, 1, seconds=5)
        assert len(woken) == (1 if rank == 1 else 0), woken
        print(f"rank {rank} ok")
        """,
)
def test_a_marked_counter_wakes_a_sleeping_rank_and_makes_no_system_call_otherwise(launched):
    """node_window's waits sleep on the other rank's counter (futex); mark() wakes them only
    when a rank raised its byte in the marker's sleepers' line. Rank 0 sleeps on bucket 0's
    counter with a 30 s limit: rank 1's mark half a second later wakes it (a missed wake-up
    would keep it 30 s), with one wake-up call; marks while nobody sleeps make none."""
    assert_ranks_ok(launched())


@needs_mpi
def test_a_step_whose_batches_change_averages_each_call_to_its_full_batch(tmp_path):
    """The step keeps the last call's key (matched by its guard) and each key's batch lengths
    between calls: compiled calls whose shards change (8 + 8 rows, 5 + 3, 3 + 5, back) each
    equal value_and_grad of that call's whole batch, the plan writing into the node window
    from the second call of each signature; a stale key or stale lengths would weight the
    ranks by another call's rows."""
    result = run_script(
        tmp_path,
        """
        from backplan.distributed.shared_exchange import WindowOutputs
        written = []
        run = WindowOutputs.run
        WindowOutputs.run = lambda self, *a: (lambda out: written.append(out is not None) or out)(
            run(self, *a))
        params = bpd.broadcast(init_mlp([8, 16, 4], seed=rank))
        step = bpd.data_parallel(vg, bucket_bytes=300)
        for rows in ((8, 8), (5, 3), (3, 5), (8, 8), (5, 3), (3, 5)):
            start = sum(rows[:rank])
            xs, ys = x[start : start + rows[rank]], y[start : start + rows[rank]]
            full_loss, full = vg(params, x[: sum(rows)], y[: sum(rows)])
            for _ in range(2):
                loss, grads = step(params, xs, ys)
                np.testing.assert_allclose(loss.item(), full_loss.item(), rtol=1e-6)
                for name in params:
                    np.testing.assert_allclose(grads[name].numpy(), full[name].numpy(),
                                               rtol=1e-5, atol=1e-7, err_msg=f"{rows} {name}")
        assert written[-6:] == [True] * 6, written  # every signature's plan writes the window
        print(f"rank {rank} ok")
        """,
        backend="numba",
        timeout=300,
    )
    assert_ranks_ok(result)


SUMMED_BOTH_WAYS = """
import os
from backplan.distributed.shared_exchange import SharedExchange

def both(make, call):
    # the same calls with the node's shared window and with MPI's allreduces
    got = {}
    for how in ("shared", "mpi"):
        os.environ["BACKPLAN_DP_REDUCTION"] = how
        step = make()
        got[how] = call(step)
        decided = getattr(step, "step", step)._reduction  # a training step's own step
        assert decided == how, (how, decided)
    return got["shared"], got["mpi"]

def same_bits(a, b, what):
    for k in a:
        x, y = np.asarray(a[k]), np.asarray(b[k])
        assert x.dtype == y.dtype and (x.view(np.uint8) == y.view(np.uint8)).all(), (what, k)

def arrays(tree):
    return {k: v.numpy().copy() for k, v in tree.items()}

def close(a, b, what, rtol=1e-5, atol=1e-7):
    for k in b:
        np.testing.assert_allclose(np.asarray(a[k]), b[k].numpy(), rtol=rtol, atol=atol,
                                   err_msg=f"{what} {k}")

starts = []
original = SharedExchange._start
SharedExchange._start = lambda self, *a: starts.append(1) or original(self, *a)
"""


@needs_mpi
@pytest.mark.parametrize("ranks, in_place", [(2, False), (3, False), (2, True), (3, True)])
def test_the_node_window_sums_exactly_as_mpi_and_one_process(tmp_path, ranks, in_place):
    """Ranks on one node sum their buckets through a shared window (shared_exchange.py): each
    rank sums its part straight from every rank's buffer. On 2 ranks each sum is a + b, as
    MPI's: the same bits as the MPI path for plain steps (averaged and summed, three calls in
    a row so both buffers of each bucket are reused), adam, ZeRO-1 (its reduce-scatter and
    all-gather in a window too), unequal shards (16 rows on 3 ranks are 6, 5, 5; 7 on 2 are 4
    and 3) and accumulate=2; on any number of ranks close to the one-process step on the whole
    batch. On 3 ranks every bucket is summed in parts (SPLIT_BYTES lowered: each rank sums its
    1/3 and copies the others'), the same bits as summed whole by every rank. in_place: every
    bucket summed in place (IN_PLACE_BYTES lowered: each rank sums its pages of the bucket into
    its own buffer, the results are views of every rank's), the same bits again, and results
    the loop keeps for seven calls stay what they were (the step takes new windows), while a
    loop that lets them go keeps one. A part summed wrong, read from the wrong buffer or not
    read back fails both."""
    result = run_script(
        tmp_path,
        SUMMED_BOTH_WAYS
        + textwrap.dedent(
            """
        from backplan.distributed import shared_exchange, window_views
        in_place = os.environ["IN_PLACE"] == "1"
        window_views.IN_PLACE_BYTES = 64 if in_place else 1 << 40
        parted = size >= shared_exchange.SPLIT_RANKS and not in_place
        if parted:  # every bucket below (bucket_bytes=300) summed in parts
            shared_exchange.SPLIT_BYTES = 64
        params = bpd.broadcast(init_mlp([8, 16, 4], seed=rank))
        m = len(x) - len(x) % size  # equal shards: a sum (average=False) of equal means
        xs, ys = bpd.shard(x[:m], rank, size), bpd.shard(y[:m], rank, size)
        full_loss, full = vg(params, x[:m], y[:m])
        exact = size == 2  # MPICH's order of more than two addends is its own

        def steps(step):
            out = [step(params, xs, ys) for _ in range(3)]
            assert all(o[0].item() == out[0][0].item() for o in out)
            return out[-1][0].item(), arrays(out[-1][1]), arrays(out[0][1])
        for average in (True, False):
            (l1, g1, first), (l2, g2, _) = both(
                lambda: bpd.data_parallel(vg, bucket_bytes=300, average=average), steps)
            same_bits(g1, first, "a returned gradient changed by later calls")
            scale = 1 if average else size
            np.testing.assert_allclose(l1, scale * full_loss.item(), rtol=1e-6)
            close({k: g / scale for k, g in g1.items()}, full, "plain")
            if exact:
                assert l1 == l2
                same_bits(g1, g2, f"plain, average={average}")
        assert len(starts) == 3 * 2 * 3, len(starts)  # 3 calls x 2 modes x 3 buckets, shared
        if parted:  # the same calls summed in parts, then whole by every rank
            os.environ["BACKPLAN_DP_REDUCTION"] = "shared"
            got = []
            for split in (64, 1 << 40):
                shared_exchange.SPLIT_BYTES = split
                step = bpd.data_parallel(vg, bucket_bytes=300, average=False)
                got.append(steps(step))
                (window,) = step.windows.values()  # per bucket: its buffer, its part's
                parts = window.counts[len(window.counts) // 2 :]
                assert all(parts) if split == 64 else not any(parts), (split, parts)
            shared_exchange.SPLIT_BYTES = 64
            assert got[0][0] == got[1][0] == l1
            same_bits(got[0][1], got[1][1], "summed in parts against summed whole")
            same_bits(got[0][1], g1, "summed in parts, again")
        if in_place:  # results kept by the loop for seven calls, then a loop that drops them
            os.environ["BACKPLAN_DP_REDUCTION"] = "shared"
            step = bpd.data_parallel(vg, bucket_bytes=300, average=False)
            kept, copies, windows, p = [], [], [], params
            for _ in range(7):
                loss, grads = step(p, xs, ys)
                kept.append(grads)
                copies.append(arrays(grads))
                (window,) = step.windows.values()
                assert window.in_place == list(range(3)), window.in_place
                windows.append(window)
                p = {k: bp.tensor(v.numpy() - 0.1 * grads[k].numpy(), requires_grad=True)
                     for k, v in p.items()}
            for got, copied in zip(kept, copies):
                same_bits(arrays(got), copied, "a kept gradient changed by later calls")
            assert len({id(w) for w in windows}) > 1  # holding them, the step took new windows
            step = bpd.data_parallel(vg, bucket_bytes=300, average=False)
            for _ in range(7):
                loss, grads = step(params, xs, ys)
            (window,) = step.windows.values()
            assert window.written == [7] * 3 + [0] * 3, window.written
            same_bits(arrays(grads), g1, "in place, the loop dropping its results")

        rows = [(0, 6), (6, 11), (11, 16)] if size == 3 else [(0, 4), (4, 7)]
        n = rows[-1][1]
        lo, hi = rows[rank]
        (l1, g1), (l2, g2) = both(
            lambda: bpd.data_parallel(vg, bucket_bytes=300),
            lambda s: (lambda r: (r[0].item(), arrays(r[1])))(s(params, x[lo:hi], y[lo:hi])))
        part_loss, part = vg(params, x[:n], y[:n])
        np.testing.assert_allclose(l1, part_loss.item(), rtol=1e-6)
        close(g1, part, "unequal shards")
        if exact:
            assert l1 == l2
            same_bits(g1, g2, "unequal shards")

        ma = len(x) - len(x) % (2 * size)  # two equal micro-batches on every rank
        xa, ya = bpd.shard(x[:ma], rank, size), bpd.shard(y[:ma], rank, size)
        half = len(xa) // 2
        micro = [(xa[:half], ya[:half]), (xa[half:], ya[half:])]
        acc_loss, acc = vg(params, x[:ma], y[:ma])
        def accumulated(step):
            step(params, *micro[0])
            loss, grads = step(params, *micro[1])
            return loss.item(), arrays(grads)
        (l1, g1), (l2, g2) = both(
            lambda: bpd.data_parallel(vg, accumulate=2, bucket_bytes=300), accumulated)
        np.testing.assert_allclose(l1, acc_loss.item(), rtol=1e-6)
        close(g1, acc, "accumulate")
        if exact:
            same_bits(g1, g2, "accumulate")

        opt = bp.optim.adam(0.01)
        one, _ = opt.update(full, opt.init(params), params)
        for sharded in (False, True):
            def trained(train):
                p, state = params, train.init(params)
                for _ in range(2):
                    p, state, loss = train(p, state, xs, ys)
                return arrays(p)
            p1, p2 = both(
                lambda: bpd.data_parallel(vg, optimizer=opt, shard_optimizer=sharded,
                                          bucket_bytes=300), trained)
            if exact:
                same_bits(p1, p2, f"adam, shard_optimizer={sharded}")
            train = bpd.data_parallel(vg, optimizer=opt, shard_optimizer=sharded)
            p, _, _ = train(params, train.init(params), xs, ys)
            close(arrays(p), one, f"adam, shard_optimizer={sharded}", atol=1e-6)
        print(f"rank {rank} ok")
        """
        ),
        ranks=ranks,
        timeout=120,
        env={"IN_PLACE": "1" if in_place else "0"},
    )
    assert_ranks_ok(result, ranks)


@needs_mpi
def test_the_compiled_plan_writes_its_gradients_into_the_node_window(tmp_path):
    """On the compiled backend, from the second call on, the plan writes the float32 buckets'
    leaves straight into this rank's window buffers of the call (no packing copy): the same
    bits as MPI's sums and as the packed first call, with aux outputs, an unsharded adam step
    and gradients held across calls unchanged."""
    result = run_script(
        tmp_path,
        SUMMED_BOTH_WAYS
        + textwrap.dedent(
            """
        from backplan.distributed.shared_exchange import WindowOutputs
        written = []
        run = WindowOutputs.run
        WindowOutputs.run = lambda self, *a: (lambda out: written.append(out is not None) or out)(
            run(self, *a))
        from backplan.distributed import shared_exchange
        outside = []  # per bucket started: leaves not already in this rank's window buffer
        def counting(self, bucket, array_of):
            window = self.windows.get((self.layout.fingerprint,))
            mine = [] if window is None else [
                window.buffer(rank, bucket.index, p) for p in range(window.generations)]
            def inside(a):
                at = np.asarray(a).ctypes.data
                return any(b.ctypes.data <= at < b.ctypes.data + b.nbytes for b in mine)
            outside.append(sum(not inside(array_of(leaf)) for leaf in bucket.leaves))
            return original(self, bucket, array_of)
        SharedExchange._start = counting
        params = bpd.broadcast(init_mlp([8, 16, 4], seed=rank))
        xs, ys = bpd.shard(x, rank, size), bpd.shard(y, rank, size)
        aux_vg = bp.value_and_grad(lambda p, a, b: (mlp_loss(p, a, b), a.sum() * 2), has_aux=True)

        def calls(step):
            out = [step(params, xs, ys) for _ in range(4)]
            return [(o[0][0].item(), o[0][1].item(), arrays(o[1])) for o in out]
        shared, mpi = both(lambda: bpd.data_parallel(aux_vg, bucket_bytes=300), calls)
        assert written[0] is False and all(written[1:4]), written  # the first call makes it
        buckets = len(outside) // 4
        assert sum(outside[:buckets]) == 5 and not any(outside[buckets:]), outside  # loss, 4 grads
        for (l1, a1, g1), (l2, a2, g2) in zip(shared, mpi):
            assert l1 == l2 and a1 == a2 and np.isclose(a1, xs.sum() * 2, rtol=1e-5)
            same_bits(g1, g2, "written into the window")
            same_bits(g1, shared[0][2], "written into the window against packed")
        held = shared[0][2]
        full_loss, full = vg(params, x, y)
        close(held, full, "written into the window")

        opt = bp.optim.adam(0.01)
        def trained(train):
            p, state = params, train.init(params)
            for _ in range(3):
                p, state, loss = train(p, state, xs, ys)
            return arrays(p)
        p1, p2 = both(lambda: bpd.data_parallel(vg, optimizer=opt, bucket_bytes=300), trained)
        same_bits(p1, p2, "adam")

        # ZeRO-1: from the second call the plan writes every gradient into this rank's send
        # buffer of the window, at its flat offset: nothing packed (225 elements, odd: rank
        # 1's range padded), the bits of MPI's reduce-scatter and of the unsharded step
        from backplan.distributed import sharding
        from backplan.distributed.sharded_outputs import ShardedWindowOutputs
        zero_written, packed = [], []
        zero_run, pack = ShardedWindowOutputs.run, sharding._pack_flat
        ShardedWindowOutputs.run = lambda self, *a: (
            lambda out: zero_written.append(out is not None) or out)(zero_run(self, *a))
        def counting_pack(send, group, flats, loss, *written):
            inside = [send.ctypes.data <= f.ctypes.data < send.ctypes.data + send.nbytes
                      for f in flats]
            packed.append(len(flats) - sum(inside))
            return pack(send, group, flats, loss, *written)
        sharding._pack_flat = counting_pack
        odd = bpd.broadcast(init_mlp([8, 17, 4], seed=rank))  # 225 elements
        def zero_trained(train):
            p, state = odd, train.init(odd)
            losses = []
            for _ in range(4):
                p, state, loss = train(p, state, xs, ys)
                losses.append(loss.item())
            return arrays(p), losses
        zero = lambda: bpd.data_parallel(vg, optimizer=opt, shard_optimizer=True)
        z1, z2 = both(zero, zero_trained)
        assert zero_written == [False, True, True, True], zero_written
        assert packed == [4, 0, 0, 0], packed  # w0, b0, w1, b1 copied in the first call only
        same_bits(z1[0], z2[0], "ZeRO-1 written into the window")
        assert z1[1] == z2[1], (z1[1], z2[1])
        plain = bpd.data_parallel(vg, optimizer=opt)
        p, state = odd, plain.init(odd)
        for _ in range(4):
            p, state, loss = plain(p, state, xs, ys)
        same_bits(z1[0], arrays(p), "ZeRO-1 against unsharded")
        print(f"rank {rank} ok", sum(written), len(written))
        """
        ),
        backend="numba",
        timeout=300,
    )
    assert_ranks_ok(result)


@needs_mpi
def test_buckets_summed_in_place_are_read_through_every_ranks_summed_pages(tmp_path):
    """On the compiled backend with every bucket summed in place (IN_PLACE_BYTES lowered): the
    plan writes its gradients into the window from the second call, each rank sums its pages
    of every rank's buffer into its own, and the gradients returned are views of every rank's
    summed pages: MPI's bits, call by call, while the parameters move. A loop that drops its
    results keeps one window; one that keeps every call's results finds them unchanged (when
    a kept result's buffers come round again the step takes a new window, that call's plan
    writing buffers of its own)."""
    result = run_script(
        tmp_path,
        SUMMED_BOTH_WAYS
        + textwrap.dedent(
            """
        from backplan.distributed import window_views
        from backplan.distributed.shared_exchange import WindowOutputs
        window_views.IN_PLACE_BYTES = 64
        written = []
        run = WindowOutputs.run
        WindowOutputs.run = lambda self, *a: (lambda out: written.append(out is not None) or out)(
            run(self, *a))
        params = bpd.broadcast(init_mlp([8, 16, 4], seed=rank))
        xs, ys = bpd.shard(x, rank, size), bpd.shard(y, rank, size)

        def looped(keep):
            def loop(step):
                kept, copies, windows, p = [], [], [], params
                for _ in range(7):
                    loss, grads = step(p, xs, ys)
                    if keep:
                        kept.append(grads)
                    copies.append(arrays(grads))
                    windows.extend(step.windows.values())
                    p = {k: bp.tensor(v.numpy() - 0.1 * grads[k].numpy(), requires_grad=True)
                         for k, v in p.items()}
                for got, copied in zip(kept, copies):
                    same_bits(arrays(got), copied, "a kept gradient changed by later calls")
                return copies, windows
            return loop

        for keep in (False, True):
            written.clear()
            (c1, w1), (c2, _) = both(lambda: bpd.data_parallel(vg, bucket_bytes=300), looped(keep))
            for g1, g2 in zip(c1, c2):
                same_bits(g1, g2, f"in place, keeping the results: {keep}")
            n = len(w1[-1].counts) // 2
            assert w1[-1].in_place == list(range(n)), w1[-1].in_place
            if keep:  # new windows; the calls that took one ran the plan as usual
                assert len({id(w) for w in w1}) > 1 and not all(written[1:7]), written
            else:
                assert all(w is w1[0] for w in w1) and w1[0].written == [7] * n + [0] * n
                assert written[:7] == [False] + [True] * 6, written
        full_loss, full = vg(params, x, y)
        close(c1[0], full, "in place")
        print(f"rank {rank} ok")
        """
        ),
        backend="numba",
        timeout=300,
    )
    assert_ranks_ok(result)


@needs_mpi
def test_a_step_given_numpy_arrays_binds_its_call_once(tmp_path):
    """On the compiled backend a step whose parameters and batch are NumPy arrays finds its
    joint plan's inputs as value_and_grad's fast path does, by the call's key, from its second
    call on: no binding of the call (signature, pytree walk, tracing cache lookup) per call,
    which cost three lookups a call (0.5-0.7 ms of CPU a step at load 16 on a model whose
    value_and_grad takes 16 us); the same bits every call, and the caller's array changed after
    a call does not change what the call returned (an aux output that is the batch itself)."""
    result = run_script(
        tmp_path,
        """
        params = bpd.broadcast(init_mlp([8, 16, 4], seed=rank))
        xs, ys = bpd.shard(x, rank, size).copy(), bpd.shard(y, rank, size)
        with_batch = bp.value_and_grad(lambda p, a, b: (mlp_loss(p, a, b), a), has_aux=True)
        for fn in (vg, with_batch):
            step = bpd.data_parallel(fn)
            looked = []
            lookup = fn.lookup
            fn.lookup = lambda *a, **k: looked.append(1) or lookup(*a, **k)
            first = [step(params, xs, ys) for _ in range(2)]
            before = len(looked)
            for _ in range(4):
                out, grads = step(params, xs, ys)
                for k in grads:
                    assert (grads[k].numpy() == first[0][1][k].numpy()).all(), k
                if fn is with_batch:
                    returned, kept = out[1].numpy().copy(), xs[0, 0]
                    xs[0, 0] = kept + 1.0
                    assert (out[1].numpy() == returned).all()
                    xs[0, 0] = kept
            assert len(looked) == before, (before, len(looked))
        print(f"rank {rank} ok")
        """,
        backend="numba",
        timeout=300,
    )
    assert_ranks_ok(result)


@needs_mpi
def test_16_bit_buckets_are_written_into_the_window_in_16_bits_and_summed_widening(tmp_path):
    """bfloat16 and float16 buckets: the window holds their bit patterns, the compiled plan
    writes them there from the second call (nothing copied, nothing widened to a float32 copy),
    and the sum widens every rank's values to float32 as it adds them (each scaled by its
    rank's weight when ranks hold different rows), rounded once when unpacked: the bits of
    MPI's path (16 bits on the wire, or float32 sums of scaled values for unequal rows),
    averaged or summed; the checked mode's peak equals explain's on every call."""
    result = run_script(
        tmp_path,
        SUMMED_BOTH_WAYS
        + textwrap.dedent(
            """
        import ml_dtypes
        from backplan.codegen.run.memory_check import measure
        from backplan.distributed.shared_exchange import WindowOutputs
        written, copied = [], []
        run = WindowOutputs.run
        WindowOutputs.run = lambda self, *a: (lambda out: written.append(out is not None) or out)(
            run(self, *a))
        def counting(self, bucket, array_of):
            window = self.windows.get((self.layout.fingerprint,))
            if window is not None:
                mine = [window.buffer(rank, bucket.index, p) for p in range(window.generations)]
                assert mine[0].dtype == np.uint16, mine[0].dtype
                inside = lambda a: any(b.ctypes.data <= np.asarray(a).ctypes.data
                                       < b.ctypes.data + b.nbytes for b in mine)
                copied.append(sum(not inside(array_of(leaf)) for leaf in bucket.leaves))
            return original(self, bucket, array_of)
        SharedExchange._start = counting
        from backplan.distributed import window_views
        halves = (ml_dtypes.bfloat16, np.float16)
        for in_place, half in [(p, h) for p in (False, True) for h in halves]:
            # in place: each rank sums its pages widened and rounds them into its own buffer
            window_views.IN_PLACE_BYTES = 64 if in_place else 1 << 16
            params = bpd.broadcast({k: bp.tensor(v.numpy().astype(half), requires_grad=True)
                                    for k, v in init_mlp([8, 15, 4], seed=5).items()})
            for average in (True, False):
                for rows in ((0, 10), (0, 5 + 2 * rank)):  # equal, then 5 and 7 rows
                    xs = bp.tensor(bpd.shard(x, rank, size)[slice(*rows)].astype(half))
                    ys = bp.tensor(bpd.shard(y, rank, size)[slice(*rows)])
                    def calls(step):
                        out = [step(params, xs, ys)]
                        copied.clear()  # call 1 made the window: its buckets were copied in
                        out += [step(params, xs, ys) for _ in range(2)]
                        return [(o[0].item(), arrays(o[1])) for o in out], list(copied)
                    written.clear()
                    (shared, inside), (mpi, _) = both(
                        lambda: bpd.data_parallel(vg, bucket_bytes=300, average=average), calls)
                    assert written == [False, True, True], written
                    assert inside and not any(inside), inside  # calls 2, 3: by the plan
                    for (l1, g1), (l2, g2) in zip(shared, mpi):
                        assert l1 == l2, (half, average, rows, l1, l2)
                        same_bits(g1, g2, (in_place, half, average, rows))
                        assert all(g.dtype == half for g in g1.values())
            os.environ["BACKPLAN_DP_REDUCTION"] = "shared"
            step = bpd.data_parallel(vg, bucket_bytes=300)
            with measure() as m:
                peaks = []
                for _ in range(3):
                    m.restart_peak()
                    loss, grads = step(params, xs, ys)  # held, as a loop holds them
                    peaks.append(m.peak)
            report = step.explain(params, xs, ys)
            peak = report.rank_peak
            assert peaks == [peak.first_call.counted_bytes] + [peak.counted_bytes] * 2, (
                in_place, half, peaks, peak.first_call.counted_bytes, peak.counted_bytes)
            for row, bucket in zip(report.buckets, step.layout((params, xs, ys)).buckets):
                assert row.bytes_sent == bucket.nbytes, (row, bucket)  # the other's 16 bits
            window = next(iter(step.windows.values()))
            assert bool(window.in_place) == in_place, window.in_place
            if in_place:  # the gradients returned: 16-bit views of the window, no copies
                assert all(not g.numpy().flags.owndata for g in grads.values())
        print(f"rank {rank} ok")
        """
        ),
        backend="numba",
        timeout=300,
        env={"BACKPLAN_CHECK_MEMORY": "1"},
    )
    assert_ranks_ok(result)


@needs_mpi
@in_one_launch(
    """
        import os
        os.environ["BACKPLAN_DP_REDUCTION"] = ("shared", "mpi")[rank]
        params = bpd.broadcast(init_mlp([8, 16, 4], seed=rank))
        step = bpd.data_parallel(vg, timeout=30)
        try:
            step(params, bpd.shard(x, rank, size), bpd.shard(y, rank, size))
        except bpd.RankMismatchError as error:
            assert "reduction" in str(error) and "'shared'" in str(error), str(error)
            assert "'mpi'" in str(error), str(error)
        else:
            raise AssertionError("ranks summing two ways went unnoticed")
        print(f"rank {rank} ok")
        """,
)
def test_ranks_summing_in_the_window_and_by_mpi_raise_instead_of_hanging(launched):
    """A rank asking for MPI's allreduce (BACKPLAN_DP_REDUCTION=mpi) beside one summing in
    the node's window would wait for buckets the other never sends: the agreement names the
    setting on every rank before anything moves."""
    assert_ranks_ok(launched())


@needs_mpi
def test_a_steps_node_windows_are_freed_with_it_and_leave_no_file(tmp_path):
    """A step's windows (plain, and ZeRO-1's) are mapped while it lives and unmapped once it
    is collected, on every rank; no segment's file outlives the call that made it. A second
    step of the same layout makes its own window and sums the same bits."""
    result = run_script(
        tmp_path,
        """
        import gc, os, weakref
        def mapped():  # this process's mappings of the ranks' segments (files unlinked)
            with open("/proc/self/maps") as maps:
                return sum("/backplan-" in line for line in maps)
        def files():
            return [f for f in os.listdir("/dev/shm") if f.startswith(f"backplan-{os.getpid()}-")]
        def mapped_bytes():  # every rank's segment, each the whole pages explain counts
            spans = [line.split()[0].split("-") for line in open("/proc/self/maps")
                     if "/backplan-" in line]
            return sum(int(b, 16) - int(a, 16) for a, b in spans)
        from backplan.distributed.shared_exchange import window_bytes
        params = bpd.broadcast(init_mlp([8, 16, 4], seed=rank))
        xs, ys = bpd.shard(x, rank, size), bpd.shard(y, rank, size)
        before, held = mapped(), mapped_bytes()
        step = bpd.data_parallel(vg, timeout=30)
        loss, grads = step(params, xs, ys)
        assert step.reduction(bpd.init()) == "shared"
        # the communicator's agreement window (node_agreement.py), made with the node probe by
        # the first exchanging call and kept while the process lives: a page per rank
        from backplan.distributed.node_window import resident_bytes
        from backplan.distributed.shared_exchange import node_agreement
        agreeing = node_agreement(bpd.init().comm)
        before, held = before + size, held + size * resident_bytes(agreeing.nbytes)
        (window,) = step.windows.values()
        assert mapped() == before + size, (mapped(), before)  # every rank's segment, once
        assert not files(), files()
        other = bpd.data_parallel(vg, timeout=30)
        loss2, grads2 = other(params, xs, ys)
        assert next(iter(other.windows.values())) is not window
        assert mapped() == before + 2 * size
        # two steps of one layout: two windows, each counted by its own step's explain
        assert mapped_bytes() - held == 2 * size * window_bytes(step.layout((params, xs, ys)), size)
        for n in grads:
            assert (grads[n].numpy() == grads2[n].numpy()).all(), n
        gone = weakref.ref(window)
        del step, window, other, loss, grads, loss2, grads2
        gc.collect()
        assert gone() is None and mapped() == before, (gone(), mapped(), before)
        train = bpd.data_parallel(vg, optimizer=bp.optim.adam(0.01), shard_optimizer=True,
                                  timeout=30)
        state = train.init(params)
        p, state, loss = train(params, state, xs, ys)
        assert mapped() == before + size and not files()
        del train, state, p, loss
        gc.collect()
        assert mapped() == before, (mapped(), before)
        print(f"rank {rank} ok")
        """,
    )
    assert_ranks_ok(result)


@needs_mpi
def test_a_rank_killed_while_the_others_wait_to_share_memory_leaves_no_file(tmp_path):
    """Rank 1 raises before its first step, so MPI_Abort kills rank 0 while it waits for the
    others in the node probe (no timeout): its segment's file was unlinked as it was made, so
    /dev/shm holds nothing of it (the others open it through /proc/PID/fd/FD)."""
    result = run_script(
        tmp_path,
        """
        import os
        print(f"rank {rank} pid {os.getpid()}", flush=True)
        params = init_mlp([8, 16, 4])
        if rank == 1:
            import time
            time.sleep(3)  # rank 0 is waiting in the probe by then
            raise RuntimeError("rank 1 fails before its first step")
        bpd.data_parallel(vg)(params, bpd.shard(x, rank, size), bpd.shard(y, rank, size))
        print(f"rank {rank} finished")
        """,
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "finished" not in result.stdout, output
    pid = next(line.split()[-1] for line in result.stdout.splitlines() if "rank 0 pid" in line)
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"backplan-{pid}-")], output


@needs_mpi
@in_one_launch(
    """
        from backplan.distributed import node_window
        params = bpd.broadcast(init_mlp([8, 16, 4], seed=rank))
        xs, ys = bpd.shard(x, rank, size), bpd.shard(y, rank, size)
        shared = bpd.data_parallel(vg, timeout=30)
        want = shared(params, xs, ys)[1]
        assert shared.reduction(bpd.init()) == "shared"
        from mpi4py import MPI
        apart = MPI.COMM_WORLD.Dup()  # a new communicator is probed anew
        if rank == 1:
            node_window.SHARED_FOLDER = "/nonexistent-folder"
        step = bpd.data_parallel(vg, comm=apart, timeout=30)
        got = step(params, xs, ys)[1]
        assert step.reduction(bpd.init(apart)) == "mpi" and not step.windows
        for n in want:
            assert (want[n].numpy() == got[n].numpy()).all(), n
        print(f"rank {rank} ok")
        """,
)
def test_ranks_that_cannot_map_each_others_memory_sum_by_mpi_alike(launched):
    """The node probe (shared_exchange.reduction) asks whether every rank maps every other's
    shared memory, not just whether MPI calls them one node: where rank 1 cannot make its
    segment (as on another machine), both ranks sum by MPI, with the same bits as the window."""
    assert_ranks_ok(launched())


# the end of the scripts below: a rank that raises RankTimeoutError says so and ends
STEP_RAISING_TIMEOUT = """
try:
    step(params, xs, ys)
except bpd.RankTimeoutError as error:
    print(f"rank {{rank}} raised RankTimeoutError: {{error}}", flush=True)
    os._exit(3)  # ends this rank with its output written; mpiexec then ends the stopped one
print(f"rank {{rank}} finished")
"""


STOPPED_BEFORE_MEETING = (
    """
import os, signal
from backplan.distributed import shared_exchange
params = init_mlp([8, 16, 4])
xs, ys = bpd.shard(x, rank, size), bpd.shard(y, rank, size)
bpd.data_parallel(vg)(params, xs, ys)  # traces, compiles and probes with no deadline to miss
{fresh}
step = bpd.data_parallel(vg, timeout=2{comm})
if rank == 1:
    shared_exchange.{name} = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGSTOP)
"""
    + STEP_RAISING_TIMEOUT
)


@needs_mpi
@pytest.mark.parametrize(
    "name, where",
    [
        ("NodeWindow", "the allocation of the node window of mlp_loss()"),
        ("share", "the shared-memory probe of mlp_loss()"),
    ],
)
def test_a_rank_stopped_before_the_node_window_is_named_after_the_timeout(tmp_path, name, where):
    """SIGSTOP on rank 1 where the ranks would make a window together (a new step's first
    call) or probe their node (a new communicator's first step): rank 0 raises
    RankTimeoutError naming rank 1 after the step's timeout, as everywhere else in the step,
    where MPI's Win_allocate_shared or Comm_split_type would have waited forever."""
    fresh = "from mpi4py import MPI; apart = MPI.COMM_WORLD.Dup()" if name == "share" else ""
    comm = ", comm=apart" if name == "share" else ""
    script = STOPPED_BEFORE_MEETING.format(fresh=fresh, comm=comm, name=name)
    result = run_script(tmp_path, script)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "finished" not in result.stdout, output
    assert (
        f"rank 0 raised RankTimeoutError: rank 0 of 2 waited 2 s (data_parallel timeout) at "
        f"{where}, but rank 1 did not arrive" in output
    ), output


@needs_mpi
def test_one_rank_without_mpiexec_is_the_plain_step(tmp_path):
    result = run_script(
        tmp_path,
        """
        params = init_mlp([8, 16, 4])
        step = bpd.data_parallel(vg)
        assert size == 1
        assert bpd.shard(x, rank, size) is not None and bpd.broadcast(params) is params
        loss, grads = step(params, x, y)
        full_loss, full = vg(params, x, y)
        assert loss.item() == full_loss.item()
        assert all((grads[k].numpy() == full[k].numpy()).all() for k in params)
        print(f"rank {rank} ok")
        """,
        ranks=None,
    )
    assert_ranks_ok(result, ranks=1)


@needs_mpi
@in_one_launch(
    """
        def expect_mismatch(params, *pieces, xs=bpd.shard(x, rank, size)):
            try:
                bpd.data_parallel(vg)(params, xs, bpd.shard(y, rank, size))
            except bpd.RankMismatchError as error:
                for piece in pieces:
                    assert piece in str(error), (piece, str(error))
            else:
                raise AssertionError("mismatch went unnoticed")

        params = init_mlp([8, 16 + rank, 4])
        expect_mismatch(params, "rank 1", "grad['w0'] is f32[8, 17]", "rank 0's is f32[8, 16]")
        params = init_mlp([8, 16, 4], dtype=np.float64 if rank else np.float32)
        expect_mismatch(params, "rank 1's grad['w0'] is f64[8, 16]", "bpd.broadcast(params)")
        params = init_mlp([8, 16, 4])
        if rank == 1:
            params["z"] = bp.tensor(np.zeros(3, np.float32), requires_grad=True)  # unused
        expect_mismatch(params, "rank 1 has grad['z'], which rank 0 lacks")
        # a batch of another dtype changes the loss's dtype: named as the argument, not the loss
        xs = bpd.shard(x, rank, size).astype(np.float64 if rank else np.float32)
        expect_mismatch(
            init_mlp([8, 16, 4]),
            "rank 1's argument 1 is float64[rows, 8] but rank 0's is float32[rows, 8]",
            "the arguments not differentiated (the batch)",
            xs=xs,
        )
        try:
            bpd.broadcast(init_mlp([8, 16 - rank, 4]))
        except bpd.RankMismatchError as error:
            expected = "rank 1's tree leaf ['w0'] is float32[8, 15] but rank 0's is float32[8, 16]"
            assert expected in str(error), str(error)
        else:
            raise AssertionError("broadcast mismatch went unnoticed")
        print(f"rank {rank} ok")
        """,
)
def test_mismatched_ranks_raise_on_every_rank_before_any_gradient_moves(launched):
    result = launched()
    assert_ranks_ok(result)


@needs_mpi
@in_one_launch(
    """
        params = bpd.broadcast(init_mlp([8, 16, 4]))
        xs, ys = bpd.shard(x, rank, size), bpd.shard(y, rank, size)
        try:
            bpd.data_parallel(vg, average=rank == 0)(params, xs, ys)
        except bpd.RankMismatchError as error:
            assert "rank 1's step has average=False but rank 0's has average=True" in str(error)
        else:
            raise AssertionError("a summing rank paired with an averaging one went unnoticed")
        opt = bp.optim.sgd(0.1)
        train = bpd.data_parallel(vg, optimizer=opt, shard_optimizer=rank == 1)
        try:
            train(params, train.init(params), xs, ys)
        except bpd.RankMismatchError as error:
            assert "rank 1's step has shard_optimizer=True" in str(error), str(error)
        else:
            raise AssertionError("a sharded rank paired with an unsharded one went unnoticed")
        loss, grads = bpd.data_parallel(vg)(params, xs, ys)
        full_loss, _ = vg(params, x, y)
        np.testing.assert_allclose(loss.item(), full_loss.item(), rtol=1e-6)
        print(f"rank {rank} ok")
        """,
)
def test_ranks_calling_steps_made_differently_raise_instead_of_mixing_their_sums(launched):
    """A step that averages paired with one that sums, or a ZeRO-1 step with an unsharded one,
    exchanged buckets of the same layout: every rank got a different answer and none raised
    (the sharded pair mixed a reduce-scatter with an allreduce). The agreement now carries the
    step's kind; every rank raises RankMismatchError naming the setting, and a step made alike
    then runs on every rank."""
    result = launched()
    assert_ranks_ok(result)


@needs_mpi
def test_a_rank_whose_driver_is_still_building_pairs_its_buckets_with_the_others(tmp_path):
    """Under BACKPLAN_DRIVER=background each rank loads the driver that starts the allreduces
    when its own build ends, so for some calls one rank starts its buckets inside the call, in
    the driver's order, and another after it, in bucket order. Here bucket 0 (b's gradient, a
    literal) starts after the call and bucket 1 inside it: MPI paired rank 0's bucket 1 with
    rank 1's bucket 0, and both returned wrong sums (NaN) without an error. The agreement now
    says whether every rank starts them inside; if not, all start them after the call."""
    result = run_script(
        tmp_path,
        """
        from backplan.distributed.in_plan import InPlanExchange
        params = init_mlp([8, 16, 4], seed=0)
        xs = bpd.shard(x, rank, size)
        mixed = bp.value_and_grad(lambda p, a: bp.sum(bp.relu(a @ p["w"])) + p["b"] * 3.0)
        mp = {"w": params["w0"], "b": bp.tensor(np.float32(1.0), requires_grad=True)}
        want_loss, want = bpd.data_parallel(mixed, bucket_bytes=16, overlap=False)(mp, xs)
        step = bpd.data_parallel(mixed, bucket_bytes=16)
        started = [row.calls_in_flight is not None for row in step.explain(mp, xs).buckets]
        assert started == [False, True], started
        ready, run = InPlanExchange.ready, InPlanExchange.run
        inside = []
        InPlanExchange.run = lambda self, *args: inside.append(1) or run(self, *args)
        for building in (True, False):
            if rank == 1 and building:  # its driver still building: buckets after the call
                InPlanExchange.ready = lambda self, inputs: False
            inside.clear()
            for _ in range(2):
                loss, grads = step(mp, xs)
                assert loss.item() == want_loss.item(), (building, loss.item(), want_loss.item())
                assert grads["b"].item() == 3.0
                assert (grads["w"].numpy() == want["w"].numpy()).all(), building
            assert len(inside) == (0 if building else 2), (building, inside)
            InPlanExchange.ready = ready
        print(f"rank {rank} ok")
        """,
        backend="numba",
        timeout=600,
        reduction="mpi",  # the compiled driver starts MPI's allreduces
    )
    assert_ranks_ok(result)


@needs_mpi
def test_a_rank_that_raises_ends_every_rank(tmp_path):
    result = run_script(
        tmp_path,
        """
        params = init_mlp([8, 16, 4])
        step = bpd.data_parallel(vg)
        if rank == 1:
            raise ValueError("bad batch on purpose")
        step(params, bpd.shard(x, rank, size), bpd.shard(y, rank, size))  # rank 0 waits here
        print(f"rank {rank} finished")
        """,
    )
    assert result.returncode != 0
    assert "rank 1 of 2 raised ValueError: bad batch on purpose" in result.stderr
    assert "aborting all 2 ranks" in result.stderr
    assert "finished" not in result.stdout


@needs_mpi
def test_a_hung_rank_ends_every_rank_after_the_timeout_naming_it(tmp_path):
    """Rank 1 hangs before its second step; rank 0, instead of waiting forever (spinning in
    MPI), raises after the timeout naming rank 1, and the abort ends rank 1 too."""
    result = run_script(
        tmp_path,
        """
        import time
        params = init_mlp([8, 16, 4])
        xs, ys = bpd.shard(x, rank, size), bpd.shard(y, rank, size)
        step = bpd.data_parallel(vg, timeout=2)
        loss, grads = step(params, xs, ys)
        plain_loss, plain = bpd.data_parallel(vg)(params, xs, ys)
        assert loss.item() == plain_loss.item()
        assert all((grads[k].numpy() == plain[k].numpy()).all() for k in params)
        print(f"rank {rank} stepped", flush=True)
        if rank == 1:
            time.sleep(600)  # hung: the test's own timeout is far shorter
        step(params, xs, ys)
        print(f"rank {rank} finished")
        """,
    )
    assert result.returncode != 0
    assert "rank 0 stepped" in result.stdout and "rank 1 stepped" in result.stdout
    assert "rank 0 of 2 waited 2 s (data_parallel timeout)" in result.stderr, result.stderr
    assert "rank 1 did not arrive" in result.stderr and "aborting all 2 ranks" in result.stderr
    assert "finished" not in result.stdout


@needs_mpi
def test_example_on_two_ranks_follows_the_single_process_losses(tmp_path):
    command = [MPIEXEC, "-n", "2", sys.executable, "-m", "backplan.examples.data_parallel"]
    env = dict(os.environ, BACKPLAN_BACKEND="reference", NUMBA_NUM_THREADS="1")
    result = subprocess.run(
        [*command, "--steps", "8", "--compare"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=env,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    gap = float(result.stdout.split("largest loss gap ")[1].split()[0])
    assert gap < 1e-5, result.stdout


@needs_mpi
def test_a_data_parallel_program_ends_without_mpi_warnings_in_its_output(tmp_path):
    """The memory fence's window (node_window.fence) is freed before MPI_Finalize: left
    locked, MPICH's UCX transport printed "UCX WARN object ... was not returned to mpool
    ucp_rkeys" (to stdout) on every rank as the user's program ended."""
    result = run_script(
        tmp_path,
        """
        params = bpd.broadcast(init_mlp([8, 16, 4], seed=0))
        step = bpd.data_parallel(vg)
        xs, ys = bpd.shard(x, rank, size), bpd.shard(y, rank, size)
        for _ in range(3):
            loss, grads = step(params, xs, ys)
        print(f"rank {rank} ok")
        """,
    )
    assert_ranks_ok(result)
    output = result.stdout + result.stderr
    assert "not returned to mpool" not in output and "WARN" not in output, output


# ---- sharded optimizer (ZeRO-1) and accumulation -------------------------------------------------


def test_zero1_ranges_are_contiguous_and_the_gathered_parameters_are_views_of_one_buffer():
    """Each rank owns a contiguous range of each dtype's parameters end to end (199 f32
    elements on 3 ranks: 67, 67, 65); the reduce-scatter's send buffer is the gradients end
    to end in slots of a rank's range (+ the loss last when it rides along); the all-gather's
    result is the parameters end to end, so the parameters are views of it and the next
    call's range of them is a view too (a copy for parameters of another origin)."""
    params = init_mlp([8, 15, 4])
    params["s"] = bp.tensor(np.arange(3.0))  # float64: a group of its own
    groups, arrays = sharding.groups_of(params, 3)
    f32, f64 = groups
    assert (f32.dtype, f64.dtype) == (np.float32, np.float64)
    assert f32.total == 199 and f32.block == 67 and f64.total == 3 and f64.block == 1
    assert [f32.owned(r) for r in range(3)] == [(0, 67), (67, 134), (134, 199)]
    flat = np.concatenate([arrays[p].reshape(-1) for p in f32.params])
    for rank in range(3):
        lo, hi = f32.owned(rank)
        np.testing.assert_array_equal(sharding.range_of(f32, arrays, rank), flat[lo:hi])
    copies, zeros = sharding.slots(f32, 68)  # the loss's slot last
    send = np.full(3 * 68, np.nan, np.float32)
    for k, a, b, at in copies:
        send[at : at + b - a] = arrays[f32.params[k]].reshape(-1)[a:b]
    for lo, hi in zeros:
        send[lo:hi] = 0
    send[67::68] = -1
    for rank in range(3):
        lo, hi = f32.owned(rank)
        block = send[rank * 68 : (rank + 1) * 68]
        np.testing.assert_array_equal(block[: hi - lo], flat[lo:hi])
        assert not block[hi - lo : 67].any() and block[67] == -1
    full = np.zeros(3 * 67, np.float32)
    full[:199] = flat
    viewed = list(arrays)
    for p, o, s in zip(f32.params, f32.offsets, f32.shapes, strict=True):
        viewed[p] = full[o : o + int(np.prod(s))].reshape(s)
    for rank in range(3):
        mine = sharding.range_of(f32, viewed, rank)
        assert mine.base is full and (mine == flat[slice(*f32.owned(rank))]).all()
    assert sharding.range_of(f32, arrays, 0).base is not full


def test_shard_optimizer_refuses_what_it_cannot_shard():
    vg = bp.value_and_grad(mlp_loss)
    clipped = bp.optim.chain(bp.optim.clip_by_global_norm(1.0), bp.optim.adam(1e-3))
    for opt in (clipped, bp.optim.loss_scale(bp.optim.sgd(0.1))):
        with pytest.raises(ValueError, match="updates each element from that element alone"):
            bpd.data_parallel(vg, optimizer=opt, shard_optimizer=True)
    assert bpd.data_parallel(vg, optimizer=clipped).shard_optimizer is False
    with pytest.raises(ValueError, match="pass optimizer="):
        bpd.data_parallel(vg, shard_optimizer=True)
    with pytest.raises(TypeError, match="takes a bp.optim optimizer"):
        bpd.data_parallel(vg, optimizer="adam")
    with pytest.raises(ValueError, match=r"argnums=\(0, 1\)"):
        bpd.data_parallel(bp.value_and_grad(mlp_loss, argnums=(0, 1)), optimizer=clipped)
    with pytest.raises(ValueError, match="accumulate must be a whole number"):
        bpd.data_parallel(vg, accumulate=0)
    with pytest.raises(ValueError, match="split_plan=True"):
        bpd.data_parallel(vg, accumulate=2, split_plan=True)


@needs_mpi
@in_one_launch(
    """
        params = bpd.broadcast(init_mlp([8, 15, 4], seed=rank))  # b0: 15 elements, 8 and 7
        xs, ys = bpd.shard(x, rank, size), bpd.shard(y, rank, size)
        for opt in (bp.optim.sgd(0.1, momentum=0.9), bp.optim.adam(0.01)):
            runs = {}
            for shard in (False, True):
                step = bpd.data_parallel(vg, optimizer=opt, shard_optimizer=shard,
                                         bucket_bytes=300)
                p, state = params, step.init(params)
                losses = []
                for _ in range(3):
                    p, state, loss = step(p, state, xs, ys)
                    losses.append(loss.item())
                runs[shard] = p, losses, state
            one, one_state, one_losses = params, opt.init(params), []
            for _ in range(3):
                loss, grads = vg(one, x, y)
                one, one_state = opt.update(grads, one_state, one)
                one_losses.append(loss.item())
            assert runs[True][1] == runs[False][1], runs
            np.testing.assert_allclose(runs[True][1], one_losses, rtol=1e-6)
            assert runs[True][1] == runs[False][1]  # the loss rides the reduce-scatter: same bits
            for k in params:
                assert (runs[True][0][k].numpy() == runs[False][0][k].numpy()).all(), k
                np.testing.assert_allclose(runs[True][0][k].numpy(), one[k].numpy(),
                                           rtol=1e-5, atol=1e-6)
                assert runs[True][0][k].requires_grad
            bases = {id(runs[True][0][k].numpy().base) for k in params}
            assert len(bases) == 1, "the parameters are views of the all-gather's buffer"
            moment = "momentum" if "momentum" in runs[True][2] else "mu"
            n = sum(p.numpy().size for p in params.values())  # 199: 100 and 99
            (share,) = runs[True][2][moment]
            assert share.numpy().size == (100, 99)[rank], share.numpy().size
        bpd.check_replicas(runs[True][0])
        # the parameters the last call returned are read in place (its gather's buffer), equal
        # arrays of another buffer are copied from: the same update either way
        p, _, state = runs[True]
        viewed = step(p, state, xs, ys)[0]
        copied = step({k: bp.tensor(v.numpy() + 0, requires_grad=True) for k, v in p.items()},
                      state, xs, ys)[0]
        assert all((viewed[k].numpy() == copied[k].numpy()).all() for k in p)
        rows = bpd.shard(x[:7], rank, size), bpd.shard(y[:7], rank, size)  # 4 and 3 rows
        uneven = [
            bpd.data_parallel(vg, optimizer=opt, shard_optimizer=shard)
            for shard in (False, True)
        ]
        stepped = [u(params, u.init(params), *rows)[0] for u in uneven]
        full = opt.update(vg(params, x[:7], y[:7])[1], opt.init(params), params)[0]
        for k in params:
            assert (stepped[0][k].numpy() == stepped[1][k].numpy()).all(), k
            np.testing.assert_allclose(stepped[1][k].numpy(), full[k].numpy(), rtol=1e-5,
                                       atol=1e-6)
        try:
            step(params, opt.init(params), xs, ys)  # the whole state, not this rank's share
        except TypeError as error:
            assert "pass the state step.init(params) returned" in str(error), str(error)
        else:
            raise AssertionError("the unsharded state went unnoticed")
        # an f64 parameter beside f32 ones: a reduce-scatter and an all-gather per dtype (the
        # f64 one first, as its bucket is; the f32 loss then travels alone), the same bits
        mixed = bpd.broadcast({"w": params["w0"], "s": bp.tensor(np.arange(7.0) / 7,
                                                                   requires_grad=True)})
        mixed_vg = bp.value_and_grad(
            lambda p, a: bp.sum(bp.tanh(a @ p["w"])) + bp.sum(p["s"] * p["s"]).astype("float32")
        )
        dtypes = [b.dtype for b in bpd.data_parallel(mixed_vg).layout((mixed, xs)).buckets]
        assert dtypes[0] == "f64" and "f32" in dtypes, dtypes
        got = {}
        for shard in (False, True):
            t = bpd.data_parallel(mixed_vg, optimizer=opt, shard_optimizer=shard, bucket_bytes=64)
            p, s = mixed, t.init(mixed)
            for _ in range(2):
                p, s, loss = t(p, s, xs)
            got[shard] = p, loss.item()
        assert got[True][1] == got[False][1]
        assert all((got[True][0][k].numpy() == got[False][0][k].numpy()).all() for k in mixed)
        report = step.explain(params, state, xs, ys)
        halves = 100  # rank 0's range of the 199 elements
        assert report.state_bytes_per_rank == 8 + 2 * 4 * halves, report.state_bytes_per_rank
        from backplan.tracer.pytree import flatten
        held = sum(leaf.numpy().nbytes for leaf in flatten(state)[0])  # what this rank keeps
        assert held == report.state_bytes_per_rank - 8 * rank, (held, rank)
        posted = [b for k, b in step._buffers.items() if k[0] == "send"]
        posted += [b[0] for k, b in step._buffers.items() if k[0] == "gathered"]
        assert len(posted) == 2 and report.bytes_sent_per_step == sum(
            b.nbytes * (size - 1) // size for b in posted  # N-1 of N slots
        ), (report.bytes_sent_per_step, [b.nbytes for b in posted])
        assert report.state_bytes_whole == 8 + 2 * 4 * sum(p.numpy().size for p in params.values())
        if rank == 0:
            print(report)
        print(f"rank {rank} ok")
        """,
    reduction="mpi",  # reads the MPI send buffers' bytes
)
def test_sharded_optimizer_steps_exactly_as_unsharded_and_close_to_one_process(launched):
    """ZeRO-1 on 2 ranks: each rank keeps half of every moment, and three steps of sgd with
    momentum and of adam give the bytes of the unsharded step (and the one-process run on the
    whole batch to f32 rounding), with ranks of 4 and 3 rows too; explain reports the state per
    rank."""
    result = launched()
    assert_ranks_ok(result)
    assert "of optimizer state per rank" in result.stdout and "ZeRO-1" in result.stdout
    said = " ".join(result.stdout.split())
    assert "scattered in one collective" in said, said
    assert "gathered in one collective per dtype" in said, said


@needs_mpi
@in_one_launch(
    """
        from backplan.distributed import sharding
        events = []
        class Recording:  # the value_and_grad the step runs, noting when its plan runs
            def __init__(self, fn):
                self.fn = fn
            def __getattr__(self, name):
                return getattr(self.fn, name)
            def __call__(self, *args, **kwargs):
                events.append("plan")
                return self.fn(*args, **kwargs)
        params = bpd.broadcast(init_mlp([8, 15, 4], seed=rank))
        xs, ys = bpd.shard(x, rank, size), bpd.shard(y, rank, size)
        opt = bp.optim.adam(0.01)
        for kind in ("zero1", "after the call"):
            if kind == "zero1":
                step = bpd.data_parallel(vg, optimizer=opt, shard_optimizer=True)
                inner = step.step
            else:
                step = inner = bpd.data_parallel(vg, overlap=False)
            inner.fn = Recording(vg)
            start, finish = inner._agree_start, inner._agree_finish
            inner._agree_start = lambda *a: events.append("agreement posted") or start(*a)
            inner._agree_finish = lambda *a: events.append("agreement waited") or finish(*a)
            events.clear()
            if kind == "zero1":
                state = step.init(params)
                p, state, loss = step(params, state, xs, ys)
                plain = bpd.data_parallel(vg, optimizer=opt)
                q, _, plain_loss = plain(params, plain.init(params), xs, ys)
                assert all((p[k].numpy() == q[k].numpy()).all() for k in params)
            else:
                loss, grads = step(params, xs, ys)
                plain_loss, plain = bpd.data_parallel(vg, overlap=False)(params, xs, ys)
                assert all((grads[k].numpy() == plain[k].numpy()).all() for k in params)
            assert loss.item() == plain_loss.item()
            assert events == ["agreement posted", "plan", "agreement waited"], (kind, events)
        print(f"rank {rank} ok")
        """,
)
def test_a_step_whose_buckets_start_after_the_call_posts_its_agreement_before_the_plan(launched):
    """ZeRO-1 and overlap=False start their exchange after the plan: the agreement of layouts
    is posted (non-blocking) before the plan runs and waited for after it, so the ranks meet
    once after the plan (in the exchange), not once more in the agreement; the values stay
    those of the step and a mismatch is still caught before any gradient moves."""
    result = launched()
    assert_ranks_ok(result)


FAILING_PLAN = """
class Failing:  # the value_and_grad the step runs; raises on this rank while `fail` is set
    def __init__(self, fn):
        self.fn, self.fail = fn, False
    def __getattr__(self, name):
        return getattr(self.fn, name)
    def __call__(self, *args, **kwargs):
        if self.fail:
            raise ValueError("plan failed on purpose")
        return self.fn(*args, **kwargs)
params = bpd.broadcast(init_mlp([8, 15, 4], seed=rank))
xs, ys = bpd.shard(x, rank, size), bpd.shard(y, rank, size)
"""


@needs_mpi
@in_one_launch(
    FAILING_PLAN
    + textwrap.dedent(
        """
        opt = bp.optim.adam(0.01)
        for kind in ("plain", "unsharded", "zero1", "unequal rows"):
            rows = (xs, ys) if kind != "unequal rows" else (xs[: 8 - rank], ys[: 8 - rank])
            if kind in ("plain", "unequal rows"):
                step = inner = bpd.data_parallel(vg, timeout=60 if kind == "plain" else None)
                call = lambda p, s: step(p, *rows)
                state = None
            else:
                step = bpd.data_parallel(vg, optimizer=opt, shard_optimizer=kind == "zero1")
                inner, state = step.step, step.init(params)
                call = lambda p, s: step(p, s, *rows)
            failing = inner.fn = Failing(vg)
            before = call(params, state)
            failing.fail = rank == 0
            try:
                call(params, state)
                caught = None
            except Exception as error:
                caught = error
            if rank == 0:
                assert type(caught) is ValueError, (kind, caught)
                assert "completed this call's exchange with NaN" in caught.__notes__[0]
            else:
                assert isinstance(caught, bpd.RankFailedError), (kind, caught)
                assert "rank 0 of 2 raised ValueError: plan failed on purpose" in str(caught)
                assert "data-parallel step of mlp_loss()" in str(caught)
            failing.fail = False
            after = call(params, state)  # pairs with the same call on the other rank
            a, b = (before, after) if kind in ("plain", "unequal rows") else (before[0], after[0])
            a = a[1] if kind in ("plain", "unequal rows") else a
            b = b[1] if kind in ("plain", "unequal rows") else b
            assert all((a[k].numpy() == b[k].numpy()).all() for k in params), kind
        print(f"rank {rank} ok")
        """
    ),
)
def test_a_rank_whose_plan_raises_after_the_agreement_leaves_the_ranks_in_step(launched):
    """Rank 0's plan raises after the call posted its agreement, and the script catches it and
    calls again. Rank 0 completes the call's exchange with NaN: rank 1 gets RankFailedError
    naming rank 0 and its error, nothing is applied, and the next call on both ranks pairs
    with the next call (before: rank 0's next agreement met rank 1's gradient collective, an
    MPI error). Plain step, unsharded and ZeRO-1 training; unequal rows too."""
    result = launched()
    assert_ranks_ok(result)


@needs_mpi
@in_one_launch(
    FAILING_PLAN
    + textwrap.dedent(
        """
        def outcome(call):
            try:
                return call(), None
            except Exception as error:
                return None, error
        step = bpd.data_parallel(vg)
        before = step(params, xs, ys)
        _, caught = outcome(lambda: step(params, xs[:, :7] if rank == 0 else xs, ys))
        if rank == 0:
            assert not isinstance(caught, bpd.DistributedError), caught
            assert "told the other ranks in the agreement" in caught.__notes__[-1]
        else:
            assert isinstance(caught, bpd.RankFailedError), caught
            assert "rank 0 of 2 raised " in str(caught), str(caught)
            assert "before the ranks had agreed on the call" in str(caught)
        after = step(params, xs, ys)
        assert all((after[1][k].numpy() == before[1][k].numpy()).all() for k in params)
        acc = bpd.data_parallel(vg, accumulate=2)
        failing = acc.fn = Failing(vg)
        failing.fail = rank == 0
        _, caught = outcome(lambda: acc(params, xs[:4], ys[:4]))
        assert (type(caught).__name__ == "ValueError") == (rank == 0), caught
        failing.fail = False
        _, caught = outcome(lambda: acc(params, xs[4:], ys[4:]))
        assert isinstance(caught, bpd.RankFailedError), caught
        assert "rank 0 of 2 raised ValueError: plan failed on purpose (call 1 of a round" in (
            str(caught)
        ), str(caught)
        fresh = bpd.data_parallel(vg, accumulate=2)
        rounds = []
        for got in (acc, fresh):
            got(params, xs[:4], ys[:4])
            rounds.append(got(params, xs[4:], ys[4:]))
        assert rounds[0][0].item() == rounds[1][0].item()
        assert all((rounds[0][1][k].numpy() == rounds[1][1][k].numpy()).all() for k in params)
        print(f"rank {rank} ok")
        """
    ),
)
def test_a_rank_that_raises_before_the_agreement_tells_the_others_there(launched):
    """Rank 0's call raises before the ranks agree on it (tracing a batch of the wrong width):
    it posts the agreement marked failed, so rank 1 raises RankFailedError instead of waiting,
    and the next calls pair. Accumulating, rank 0's first micro-batch raises (no MPI call on
    either rank): the round's last call raises RankFailedError on both ranks, naming rank 0's
    call 1, and the next round pairs and gives the bytes of a fresh step's round. Before: rank
    1 waited in the agreement, which rank 0's next call met (the next round's calls shifted)."""
    result = launched()
    assert_ranks_ok(result)


@needs_mpi
@in_one_launch(
    FAILING_PLAN
    + textwrap.dedent(
        """
        opt = bp.optim.adam(0.01)
        train = bpd.data_parallel(vg, optimizer=opt, shard_optimizer=True)
        p, state, _ = train(params, train.init(params), xs, ys)
        update = train._update
        def failing(*args):
            raise ValueError("update failed on purpose")
        if rank == 0:
            train._update = failing
        try:
            train(p, state, xs, ys)
        except Exception as error:
            caught = error
        train._update = update
        if rank == 0:
            assert type(caught) is ValueError and "joined this call's all-gather" in (
                caught.__notes__[-1]
            ), caught
        else:
            assert isinstance(caught, bpd.RankFailedError), caught
            assert "rank 0 of 2 raised ValueError: update failed on purpose" in str(caught)
            assert "in its ZeRO-1 update" in str(caught), str(caught)
        q, _, loss = train(p, state, xs, ys)
        plain = bpd.data_parallel(vg, optimizer=opt)
        r, s, _ = plain(params, plain.init(params), xs, ys)
        r2, _, plain_loss = plain(r, s, xs, ys)
        assert loss.item() == plain_loss.item()
        assert all((q[k].numpy() == r2[k].numpy()).all() for k in params)
        if rank == 0:
            plain._update = failing
        try:
            plain(r, s, xs, ys)
            caught = None
        except ValueError as error:
            caught = error
        assert (caught is not None) == (rank == 0), caught
        plain._update = update
        try:
            plain(r, s, xs, ys)
        except Exception as error:
            caught = error
        if rank == 0:
            assert type(caught) is bpd.RankOutOfStepError, caught
        else:
            assert isinstance(caught, bpd.RankFailedError), caught
        said = str(caught)
        assert "raised ValueError: update failed on purpose in its update of an earlier" in said
        assert "the ranks no longer hold the same parameters" in said, said
        print(f"rank {rank} ok")
        """
    ),
)
def test_a_rank_whose_update_raises_tells_the_others(launched):
    """Rank 0's ZeRO-1 update raises (between the reduce-scatter and the all-gather): it joins
    the all-gather with NaN in place of its range, rank 1 raises RankFailedError instead of waiting
    there (before: forever, or returning rank 0's stale range), and the next call, from the
    same parameters and state, gives the bytes of the unsharded step. Unsharded, rank 1 has
    applied its update when rank 0's raises: rank 0's next call tells rank 1 (RankFailedError:
    the ranks no longer hold the same parameters) and raises RankOutOfStepError (before: the
    ranks went on from different parameters, silently)."""
    result = launched()
    assert_ranks_ok(result)


@needs_mpi
def test_a_rank_that_raises_while_another_hangs_ends_the_job_without_a_timeout(tmp_path):
    """No data_parallel timeout: rank 0's plan raises after the agreement while rank 1's hangs.
    Rank 0 waits for rank 1 to complete the call's exchange SETTLE_S seconds at most (2 here),
    then its error, noting that, ends both ranks (MPI_Abort). Before: rank 0 waited forever."""
    result = run_script(
        tmp_path,
        FAILING_PLAN
        + textwrap.dedent(
            """
        import time
        from backplan.distributed import failure
        failure.SETTLE_S = 2
        class Hanging(Failing):
            def __call__(self, *args, **kwargs):
                if self.fail and rank == 1:
                    time.sleep(300)
                return super().__call__(*args, **kwargs)
        step = bpd.data_parallel(vg)
        step(params, xs, ys)
        hanging = step.fn = Hanging(vg)
        hanging.fail = True
        step(params, xs, ys)
        print(f"rank {rank} finished")
        """
        ),
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "finished" not in output, output
    assert "rank 0 of 2 raised ValueError: plan failed on purpose" in output, output
    assert "RankTimeoutError" in output and "within 2 s" in output, output


@needs_mpi
def test_a_rank_that_raises_around_its_compiled_step_settles_or_says_it_is_out_of_step(tmp_path):
    """On the compiled backend the driver starts the buckets itself. Rank 0 raising before its
    driver ran (nothing posted) posts the buckets in the drivers' order with NaN: rank 1 gets
    RankFailedError and the next call pairs again. Rank 0 raising after its driver returned
    (as a KeyboardInterrupt deferred through the compiled call would) cannot fix what it
    posted: its next call raises RankOutOfStepError naming the rank and the first error
    before any MPI call and, uncaught, ends both ranks (before, either way: its agreement
    went on to meet whatever rank 1 posted next)."""
    result = run_script(
        tmp_path,
        """
        from backplan.distributed.in_plan import InPlanExchange
        params = init_mlp([8, 16, 4])
        xs, ys = bpd.shard(x, rank, size), bpd.shard(y, rank, size)
        step = bpd.data_parallel(vg, bucket_bytes=300)
        before = step(params, xs, ys)
        print(f"rank {rank} driver starts buckets: {step.wait_for_driver(params, xs, ys)}")
        run = InPlanExchange.run
        def failing(self, *args):
            if rank == 0 and where == "before":
                raise ValueError("failed before the driver")
            outputs = run(self, *args)
            if rank == 0 and where == "after":
                raise ValueError("interrupted after the driver")
            return outputs
        InPlanExchange.run = failing
        for where in ("before", None, "after"):
            try:
                loss, grads = step(params, xs, ys)
            except Exception as error:
                print(f"rank {rank} caught {type(error).__name__}: {error}", flush=True)
                continue
            if where is None:  # the call after the settled one paired: the values before it
                assert loss.item() == before[0].item()
                assert all((grads[k].numpy() == before[1][k].numpy()).all() for k in params)
                print(f"rank {rank} paired again", flush=True)
        where = None
        step(params, xs, ys)  # rank 0: RankOutOfStepError, uncaught
        print(f"rank {rank} finished")
        """,
        backend="numba",
        timeout=600,
        reduction="mpi",  # the compiled driver starts MPI's allreduces
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "rank 0 driver starts buckets: True" in result.stdout, output
    assert "rank 0 caught ValueError: failed before the driver" in result.stdout, output
    assert "rank 1 caught RankFailedError: rank 0 of 2 raised ValueError: failed before" in (
        result.stdout
    ), output
    assert "rank 0 paired again" in result.stdout and "rank 1 paired again" in result.stdout
    assert "rank 0 caught ValueError: interrupted after the driver" in result.stdout, output
    assert "rank 0 of 2 raised RankOutOfStepError: this rank (0 of 2) raised ValueError: " in (
        output
    )
    assert "compiled step had started part of that call's exchange itself" in output
    assert "finished" not in result.stdout, output


@needs_mpi
@in_one_launch(
    """
        from mpi4py import MPI
        params = bpd.broadcast(init_mlp([8, 16, 4], seed=rank))
        xs, ys = bpd.shard(x, rank, size), bpd.shard(y, rank, size)
        micro = [(xs[:4], ys[:4]), (xs[4:], ys[4:])]
        step = bpd.data_parallel(vg, accumulate=2, bucket_bytes=300, timeout=40)
        if rank == 1:
            MPI.COMM_WORLD.recv(source=0)
        first_loss, nothing = step(params, *micro[0])
        if rank == 0:
            MPI.COMM_WORLD.send("done", dest=1)
        assert nothing is None
        np.testing.assert_allclose(first_loss.item(), vg(params, *micro[0])[0].item())
        loss, grads = step(params, *micro[1])
        full_loss, full = vg(params, x, y)
        np.testing.assert_allclose(loss.item(), full_loss.item(), rtol=1e-6)
        for k in params:
            np.testing.assert_allclose(grads[k].numpy(), full[k].numpy(), rtol=1e-5, atol=1e-7)
        opt = bp.optim.adam(0.01)
        train = bpd.data_parallel(vg, optimizer=opt, shard_optimizer=True, accumulate=2)
        p, state = params, train.init(params)
        p, state, _ = train(p, state, *micro[0])
        assert p is params
        p, state, loss = train(p, state, *micro[1])
        one, _ = opt.update(full, opt.init(params), params)
        for k in params:
            np.testing.assert_allclose(p[k].numpy(), one[k].numpy(), rtol=1e-5, atol=1e-6)
        try:
            step(params, xs[:3], ys[:3])
            step(params, xs[:2], ys[:2])
        except bpd.DistributedError as error:
            assert "micro-batches of one round must hold equal rows" in str(error), str(error)
        else:
            raise AssertionError("micro-batches of different rows went unnoticed")
        print(f"rank {rank} ok")
        """,
)
def test_accumulate_exchanges_once_per_k_calls_as_one_big_batch(launched):
    """accumulate=2: the first call of a round exchanges nothing (rank 1 does not reach its
    first call until rank 0 has finished its own, and a collective there would time out); the
    second returns the 4 micro-batches' mean over both ranks, the whole batch's; with a sharded
    optimizer it steps as one step on the whole batch."""
    result = launched()
    assert_ranks_ok(result)


@needs_mpi
@in_one_launch(
    """
        import ml_dtypes
        k = 4
        for half in (ml_dtypes.bfloat16, np.float16):
            params = bpd.broadcast({n: bp.tensor(v.numpy().astype(half), requires_grad=True)
                                    for n, v in init_mlp([8, 15, 4], seed=3).items()})
            x16 = x.astype(half)
            def micro(r):
                xs, ys = bpd.shard(x16, r, size), bpd.shard(y, r, size)
                n = len(xs) // k
                return [(xs[i * n:(i + 1) * n], ys[i * n:(i + 1) * n]) for i in range(k)]
            step = bpd.data_parallel(vg, accumulate=k, bucket_bytes=300)
            for i, batch in enumerate(micro(rank)):
                loss, grads = step(params, *batch)
                assert (grads is None) == (i < k - 1)
            want32, want16 = {}, {}
            for r in range(size):
                sums32, sums16 = {}, {}
                for batch in micro(r):
                    _, g = vg(params, *batch)
                    for n in params:
                        a = g[n].numpy()
                        sums32[n] = sums32.get(n, 0) + a.astype(np.float32)
                        sums16[n] = (sums16[n] + a) if n in sums16 else a
                for n in params:
                    want32[n] = want32.get(n, 0) + sums32[n] / np.float32(k)
                    want16[n] = want16.get(n, 0) + sums16[n].astype(np.float32) / np.float32(k)
            differs = False
            for n in params:
                assert grads[n].numpy().dtype == half, (n, grads[n].numpy().dtype)
                expected = (want32[n] / np.float32(size)).astype(half)
                got = grads[n].numpy()
                mismatched = int((got.view(np.uint16) != expected.view(np.uint16)).sum())
                assert mismatched == 0, (half.__name__, n, mismatched, got.size)
                rounded_k_times = (want16[n] / np.float32(size)).astype(half)
                differs |= bool((rounded_k_times != expected).any())
            assert differs, "these batches do not tell a 16-bit running sum from float32"
            assert loss.numpy().dtype == vg(params, *micro(rank)[0])[0].numpy().dtype
            opt = bp.optim.sgd(0.5)
            stepped = {}
            for shard in (False, True):
                train = bpd.data_parallel(vg, optimizer=opt, shard_optimizer=shard, accumulate=k)
                p, state = params, train.init(params)
                for batch in micro(rank):
                    p, state, loss = train(p, state, *batch)
                stepped[shard] = p, loss
            assert stepped[True][1].numpy().dtype == stepped[False][1].numpy().dtype
            assert stepped[True][1].item() == stepped[False][1].item()
            for n in params:
                assert stepped[True][0][n].numpy().dtype == half
                assert (stepped[True][0][n].numpy() == stepped[False][0][n].numpy()).all(), n
            one, _ = opt.update(grads, opt.init(params), params)
            for n in params:
                assert (stepped[False][0][n].numpy() == one[n].numpy()).all(), n
        print(f"rank {rank} ok")
        """,
)
def test_accumulated_16_bit_gradients_are_summed_in_float32_and_rounded_once(launched):
    """accumulate=4 with bfloat16 and float16 parameters: the micro-batches' gradients are added
    in float32 and rounded into the 16-bit dtype once, after the sum over the ranks, as one big
    batch's would be (they were added in 16 bits: bfloat16 keeps 8 bits, so each of the k - 1
    additions rounded). The reference adds every rank's micro-batch gradients in float32 here;
    the 16-bit running sum it replaces differs from it on these batches. ZeRO-1 with the same
    accumulation returns the loss in its dtype and the unsharded step's parameters."""
    result = launched()
    assert_ranks_ok(result)


# ---- a rank that dies or stops mid-step ----------------------------------------------------------

DIES_IN_THE_EXCHANGE = (
    """
import os, signal
from backplan.distributed.exchange import Exchange
from backplan.distributed.in_plan import InPlanExchange
params = init_mlp([8, 16, 4])
xs, ys = bpd.shard(x, rank, size), bpd.shard(y, rank, size)
bpd.data_parallel(vg)(params, xs, ys)  # traces and compiles with no deadline to miss
step = bpd.data_parallel(vg, timeout={timeout})
step(params, xs, ys)
inside = step.wait_for_driver(params, xs, ys)
print(f"rank {{rank}} stepped, driver starts buckets: {{inside}}", flush=True)
if rank == 1:  # mid-step: after the roll call and the agreement, before its buckets move
    {where}.{method} = lambda self, *args: os.kill(os.getpid(), signal.{signal})
"""
    + STEP_RAISING_TIMEOUT
)


@needs_mpi
def test_a_rank_killed_mid_step_ends_the_job(tmp_path):
    """SIGKILL on rank 1 inside the step: mpiexec (hydra) sees a rank end by a signal and ends
    the others at once, saying so; no rank hangs and none finishes the step."""
    script = DIES_IN_THE_EXCHANGE.format(
        timeout=30, signal="SIGKILL", where="Exchange", method="start"
    )
    result = run_script(tmp_path, script)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "rank 0 stepped" in result.stdout and "finished" not in result.stdout, output
    assert "signal 9" in output or "rank 0 raised RankTimeoutError" in output, output


@needs_mpi
def test_a_rank_stopped_mid_step_times_out_the_others_in_the_exchange(tmp_path):
    """SIGSTOP on rank 1 inside the step, where mpiexec notices nothing: rank 0 waits for the
    bucket's allreduce with the deadline and raises RankTimeoutError saying what did not
    complete and which rank never reached it, instead of waiting forever."""
    script = DIES_IN_THE_EXCHANGE.format(
        timeout=2, signal="SIGSTOP", where="Exchange", method="start"
    )
    result = run_script(tmp_path, script)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "rank 0 raised RankTimeoutError: the allreduce of bucket 0 did not complete " in output
    assert "within 2 s (data_parallel timeout)" in output and "finished" not in output, output
    assert "rank 0 of 2 waited, but rank 1 never reached it" in output, output


@needs_mpi
@pytest.mark.parametrize("in_place", [False, True])
def test_a_rank_stopped_in_its_part_of_a_sum_is_not_blamed_on_the_others(tmp_path, in_place):
    """3 ranks on one node, every bucket summed in parts (or in place): rank 2 stops (SIGSTOP)
    after summing its part, before marking it. Ranks 0 and 1 wait on the window's counters (no
    MPI call there) and time out; each says every rank reached the exchange, and neither names
    the other, which did (their arrival messages are moved along while they wait: without that
    a rank named a healthy one in 2 of 3 runs); in place, the error names the sums' meeting."""
    result = run_script(
        tmp_path,
        """
        import os, signal
        from backplan.distributed import shared_exchange, window_views
        shared_exchange.SPLIT_BYTES = 64
        window_views.IN_PLACE_BYTES = 64 if os.environ["IN_PLACE"] == "1" else 1 << 40
        params = bpd.broadcast(init_mlp([8, 16, 4], seed=0))
        xs, ys = bpd.shard(x, rank, size), bpd.shard(y, rank, size)
        bpd.data_parallel(vg)(params, xs, ys)  # compiled before the deadline counts
        step = bpd.data_parallel(vg, timeout=2)
        step(params, xs, ys)
        if rank == 2:
            summed = shared_exchange.SharedRequest._sum
            def stopping(self):
                summed(self)
                os.kill(os.getpid(), signal.SIGSTOP)
            shared_exchange.SharedRequest._sum = stopping
        try:
            step(params, xs, ys)
        except bpd.RankTimeoutError as error:
            print(f"rank {rank} raised RankTimeoutError: {error}", flush=True)
            os._exit(3)
        print(f"rank {rank} finished")
        """,
        ranks=3,
        timeout=120,
        env={"IN_PLACE": "1" if in_place else "0"},
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "finished" not in output, output
    waited = (
        "the node's sums in place (every rank's parts of buckets up to 0)"
        if in_place
        else "the allreduce of bucket 0"
    )
    for r in (0, 1):
        said = f"rank {r} raised RankTimeoutError: {waited} did not complete "
        assert said in output, output
    assert output.count("every rank reached it: one stopped during the transfer") == 2, output
    assert "never reached it" not in output, output


@needs_mpi
def test_a_rank_stopped_in_its_zero1_update_is_named_by_the_all_gather_timeout(tmp_path):
    """SIGSTOP on rank 1 in its ZeRO-1 update (after the reduce-scatter both ranks reached):
    rank 0's all-gather times out and names rank 1, which never reached it."""
    result = run_script(
        tmp_path,
        """
        import os, signal
        params = init_mlp([8, 16, 4])
        xs, ys = bpd.shard(x, rank, size), bpd.shard(y, rank, size)
        step = bpd.data_parallel(vg, optimizer=bp.optim.adam(0.01), shard_optimizer=True,
                                 timeout=2)
        state = step.init(params)
        params, state, loss = step(params, state, xs, ys)
        print(f"rank {rank} stepped", flush=True)
        if rank == 1:
            step._update = lambda *args: os.kill(os.getpid(), signal.SIGSTOP)
        try:
            step(params, state, xs, ys)
        except bpd.RankTimeoutError as error:
            print(f"rank {rank} raised RankTimeoutError: {error}", flush=True)
            os._exit(3)
        print(f"rank {rank} finished")
        """,
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "rank 0 stepped" in output and "finished" not in output, output
    assert "rank 0 raised RankTimeoutError: the all-gather of the float32 parameters did " in (
        output
    )
    assert "rank 0 of 2 waited, but rank 1 never reached it" in output, output


@needs_mpi
@pytest.mark.parametrize("signal", ["SIGKILL", "SIGSTOP"])
def test_a_rank_lost_before_its_compiled_step_ends_the_one_whose_driver_started(tmp_path, signal):
    """On the compiled backend rank 0's driver starts its allreduces inside the call while
    rank 1 dies (SIGKILL: mpiexec ends the job) or stops (SIGSTOP: rank 0's wait on the
    started allreduce gives up after the timeout, naming the bucket) before running its plan:
    the job ends either way, within the subprocess's limit, and no rank finishes the step."""
    script = DIES_IN_THE_EXCHANGE.format(
        timeout=2, signal=signal, where="InPlanExchange", method="run"
    )
    result = run_script(tmp_path, script, backend="numba", timeout=600, reduction="mpi")
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "rank 0 stepped, driver starts buckets: True" in result.stdout, output
    assert "finished" not in result.stdout, output
    if signal == "SIGSTOP":
        assert "rank 0 raised RankTimeoutError: the allreduce of bucket 0 did not complete " in (
            output
        )
        assert "rank 1 never reached it" in output, output
    else:
        assert "signal 9" in output or "rank 0 raised RankTimeoutError" in output, output


def test_accumulated_calls_from_four_threads_are_each_added_once():
    """400 calls of 200,000 ones from 4 threads, one round of 400: the round ends once, with a
    mean of exactly 1 (without the lock, adds racing in NumPy lost or doubled some calls)."""
    accumulator = Accumulator(400)
    arrays = [np.ones(200_000)]
    rounds: list = []

    def work():
        for _ in range(100):
            done = accumulator.add(1, (4,), arrays)
            if done is not None:
                rounds.append(done)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(rounds) == 1 and (rounds[0][0] == 1).all()
    accumulator.add(1, (4,), arrays)
    with pytest.raises(bpd.DistributedError, match=r"batch arguments of \[3\] rows but call 1"):
        accumulator.add(1, (3,), arrays)
    with pytest.raises(bpd.DistributedError, match="another structure, shapes or dtypes"):
        accumulator.add(1, (4,), arrays)  # the round goes on: its call 2
        accumulator.add(2, (4,), arrays)


@needs_mpi
@pytest.mark.parametrize("reduction", ["shared", "mpi"])
def test_explain_prints_the_peak_each_rank_holds_counted_to_the_byte(tmp_path, reduction):
    """explain's per-rank peak counts what the exchange adds to the plan (bucket buffers, the
    ZeRO-1 send, receive and all-gather buffers, the update's outputs, the outputs the plan's
    workspace keeps): the checked mode counts every buffer the step allocates or keeps, and
    runs what runs unchecked (on the node's window the plan writes its gradients straight into
    it from the second call on: no output buffers of its own then); each call's peak equals
    explain's figure to the byte, its first call's figure for the first, on both ranks, for
    the plain step, the unsharded adam step and ZeRO-1 with an odd number of parameters
    (rank 1 owns one element less: a padded range)."""
    result = run_script(
        tmp_path,
        """
        import os
        from backplan.codegen.run.memory_check import measure
        params = bpd.broadcast(init_mlp([64, 257, 3], seed=0))  # w0 64 KiB: kept by the plan
        x, y = synthetic_classification(32, 64, 3)
        xs, ys = bp.tensor(bpd.shard(x, rank, size)), bp.tensor(bpd.shard(y, rank, size))
        said = []
        shared = os.environ["BACKPLAN_DP_REDUCTION"] == "shared"
        for mode in ("plain", "adam", "zero"):
            peaks = []  # the checked mode's peak of each call
            if mode == "plain":
                step = bpd.data_parallel(vg, bucket_bytes=40_000)
                with measure() as m:
                    for i in range(4):
                        m.restart_peak()
                        loss, grads = step(params, xs, ys)
                        peaks.append(m.peak)
                report = step.explain(params, xs, ys)
            else:
                step = bpd.data_parallel(vg, optimizer=bp.optim.adam(1e-3), bucket_bytes=40_000,
                                         shard_optimizer=mode == "zero")
                p, state = params, step.init(params)
                with measure() as m:
                    for i in range(4):
                        m.restart_peak()
                        p, state, loss = step(p, state, xs, ys)
                        peaks.append(m.peak)
                report = step.explain(p, state, xs, ys)
            peak = report.rank_peak
            first = peak.first_call.counted_bytes
            assert peaks[0] == first, (mode, peaks, first, peak.counted_bytes)
            # the second call: the plan's workspace keeps the first call's big outputs while it
            # runs (w0's, where the plan writes it into the window from the second call on)
            second = peak.second_call.counted_bytes if peak.second_call else peak.counted_bytes
            assert peaks[1] == second, (mode, peaks, second, peak.counted_bytes)
            assert peaks[2:] == [peak.counted_bytes] * 2, (mode, peaks, peak.counted_bytes)
            assert report.peak_bytes == peak.most_bytes >= peak.peak_bytes > peak.between.nbytes
            assert f"Per-rank peak: {report.peak_bytes:,} B" in str(report)
            if peak.first_call is not None:  # (wrapped text: compared with single spaces)
                text = " ".join(str(report).split())
                assert f"The first call holds {peak.first_call.peak_bytes:,} B" in text, text
            if shared and mode == "plain":  # call 4: every gradient written in the window
                assert not [n for n in m.at_peak if n.startswith("output")], m.at_peak
            names = " ".join(m.at_peak)  # (shared: ZeRO-1's send buffers in the window)
            zero = "ZeRO-1 share" if shared else "ZeRO-1 send"
            assert (zero if mode == "zero" else "bucket") in names, (mode, names)
            said.append((mode, peak.peak_bytes))
            window = any(p.held.get("node window") for p in peak.phases)  # summing in it
            assert window == shared, (mode, str(report))
            phases = [p.name for p in peak.phases]
            if mode != "zero" and shared:  # after the call: summed, nothing packed from call 2
                assert "the buckets are summed after the call" in phases, (mode, phases)
                assert "the buckets are packed after the call" not in phases, (mode, phases)
        assert said[1][1] > said[0][1]  # the update's new parameters and state
        print(f"rank {rank} ok", said)
        """,
        backend="numba",
        timeout=300,
        env={"BACKPLAN_CHECK_MEMORY": "1"},
        reduction=reduction,
    )
    assert_ranks_ok(result)
