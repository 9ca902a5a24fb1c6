"""Driver builds across processes (codegen/build/driver_builder.py, codegen/build/driver_lock.py):
by default
no build outlives its program, ended or killed; under BACKPLAN_DRIVER_AT_EXIT=finish a build
still running when a program ends finishes in its detached child, so the next run starts on the
compiled driver; two processes sharing a cache folder compile a driver once; builds queued while
a child runs go to one child together.

The tests hold a driver's lock themselves to keep its build waiting at a known point, so nothing
depends on how fast a compile is."""

import json
import os
import subprocess
import sys
import time

import pytest

from backplan.codegen.build import driver_builder, driver_lock, driver_tier

pytestmark = [
    pytest.mark.skipif(
        driver_lock.fcntl is None or not os.path.isdir("/proc"), reason="needs flock and /proc"
    ),
    pytest.mark.usefixtures("child_builds"),  # no direct driver in their place
]

SCRIPT = """
import json, sys, time
import numpy as np
import backplan as bp
from backplan.codegen.build import driver_builder
from backplan.runtime.backend import use_backend

def loss(w, x):
    return bp.mean(bp.tanh(x @ w) ** 2)

w = bp.tensor(np.ones((5, 3), np.float32))
x = bp.tensor(np.ones((17, 5), np.float32))
step = bp.value_and_grad(bp.compile(loss))
with use_backend("numba"):
    step(w, x)
    plan = step.trace(w, x).runner().compiled
    print(json.dumps({"tier": plan.driver_tier, "module": plan.module_path}), flush=True)
    if sys.argv[1] in ("pid", "hang"):
        deadline = time.monotonic() + 120  # a build never submitted fails, not hangs
        while not driver_builder._running:  # the builder thread starts the child
            if time.monotonic() > deadline:
                sys.exit("no driver build started within 120 s")
            time.sleep(0.01)
        print(json.dumps({"pid": driver_builder._running[0].process.pid}), flush=True)
    if sys.argv[1] == "hang":
        sys.stdin.read()  # until the test kills this process
    if sys.argv[1] == "two":  # queued behind the first build: goes to a child started at exit
        bp.value_and_grad(bp.compile(lambda w, x: bp.mean(bp.sin(x @ w))))(w, x)
    if sys.argv[1] == "wait":
        built = driver_builder.wait_for_builds(timeout=240)
        print(json.dumps({"built": built, "now": plan.driver_tier,
                          "found_cached": plan.driver_found_cached}), flush=True)
"""


def script_env(tmp_path, **settings) -> dict:
    env = {**os.environ, "BACKPLAN_CACHE_DIR": str(tmp_path / "kernels")}
    env.pop("BACKPLAN_QUIET", None)
    return {**env, "BACKPLAN_DRIVER": "background", **settings}


def run(env: dict, mode: str = "exit", flags=("-W", "default")) -> tuple[list[dict], str]:
    """The script's JSON lines and its stderr (under -W default: ResourceWarnings shown). Returns
    only once the script's stdout and stderr are closed: a build child holding them open would
    hang here (its build is held waiting)."""
    done = subprocess.run(
        [sys.executable, *flags, "-c", SCRIPT, mode],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()], done.stderr


def module_of_plan(tmp_path) -> str:
    """The plan's module in the cache folder (BACKPLAN_DRIVER=python builds nothing)."""
    lines, _ = run(script_env(tmp_path, BACKPLAN_DRIVER="python"))
    return lines[0]["module"]


def is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"  # a zombie has finished; whoever adopted it has yet to reap it


def wait_until_finished(pid: int, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while is_running(pid):
        assert time.monotonic() < deadline, f"build process {pid} still running"
        time.sleep(0.2)


def test_asked_a_build_running_at_exit_finishes_and_the_next_run_starts_compiled(tmp_path):
    module = module_of_plan(tmp_path)
    env = script_env(tmp_path, BACKPLAN_DRIVER_AT_EXIT="finish")
    with driver_lock.held(module):  # the script's build waits: still running when it ends
        lines, err = run(env)
        assert lines[0]["tier"] == "python"
        [line] = [line for line in err.splitlines() if "still building" in line]
        pid = int(line.split("still building in process ")[1].split()[0])
        assert line.startswith("backplan: @") and f"kill {pid}" in line
        assert is_running(pid)  # left running, detached from the ended script's pipes
        assert "Warning" not in err  # no unclosed file, no "subprocess ... is still running"
    wait_until_finished(pid)
    lines, err = run(env)
    assert lines[0]["tier"] == "compiled" and "still building" not in err


def test_builds_left_at_exit_leave_no_resource_warnings(tmp_path):
    """A build queued behind a running one goes to a child started by the exit handler; under
    -W default its pipe and error file were reported unclosed, and both children as
    'subprocess ... is still running'."""
    module = module_of_plan(tmp_path)
    with driver_lock.held(module):
        _, err = run(script_env(tmp_path, BACKPLAN_DRIVER_AT_EXIT="finish"), "two")
    pids = [int(x.split()[0]) for x in err.split("still building in process ")[1:]]
    assert len(pids) == 2, err  # the held build's child, and the one started at exit
    assert "Warning" not in err


def test_by_default_the_build_stops_with_the_program_and_nothing_is_said(tmp_path):
    module = module_of_plan(tmp_path)
    env = script_env(tmp_path)
    env.pop("BACKPLAN_DRIVER_AT_EXIT", None)
    with driver_lock.held(module):
        lines, err = run(env, "pid")
        assert lines[0]["tier"] == "python"
        assert not is_running(lines[1]["pid"])  # stopped by the exit handler, held or not
    assert "backplan:" not in err
    lines, _ = run(env)
    assert lines[0]["tier"] == "python"  # nothing built it


def test_a_killed_program_leaves_no_build_running(tmp_path):
    """SIGKILL runs no exit handler: the child notices its parent is gone and stops."""
    module = module_of_plan(tmp_path)
    env = script_env(tmp_path)
    env.pop("BACKPLAN_DRIVER_AT_EXIT", None)
    with driver_lock.held(module):
        script = subprocess.Popen(
            [sys.executable, "-c", SCRIPT, "hang"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        script.stdout.readline()
        pid = json.loads(script.stdout.readline())["pid"]
        assert is_running(pid)
        script.kill()
        script.wait(timeout=60)
        script.stdout.close()
        script.stdin.close()
        wait_until_finished(pid, seconds=30)


def test_quiet_at_exit_says_nothing(tmp_path):
    module = module_of_plan(tmp_path)
    with driver_lock.held(module):
        _, err = run(script_env(tmp_path, BACKPLAN_QUIET="1", BACKPLAN_DRIVER_AT_EXIT="finish"))
    assert "backplan:" not in err


def test_an_unknown_at_exit_mode_is_refused(monkeypatch):
    monkeypatch.setenv("BACKPLAN_DRIVER_AT_EXIT", "later")
    with pytest.raises(ValueError, match=r"BACKPLAN_DRIVER_AT_EXIT='later'; use one of kill"):
        driver_tier.at_exit_mode()


def test_two_processes_sharing_a_cache_compile_a_driver_once(tmp_path):
    module = module_of_plan(tmp_path)
    env = script_env(tmp_path)
    command = [sys.executable, "-c", SCRIPT, "wait"]
    with driver_lock.held(module):  # both builds start, and wait, before either compiles
        scripts = [
            subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env) for _ in range(2)
        ]
        firsts = [json.loads(script.stdout.readline()) for script in scripts]
    results = []
    for script in scripts:
        out, _ = script.communicate(timeout=300)
        assert script.returncode == 0
        results.append(json.loads(out.splitlines()[-1]))
    assert [first["tier"] for first in firsts] == ["python", "python"]
    assert all(r["built"] and r["now"] == "compiled" for r in results), results
    assert sorted(r["found_cached"] for r in results) == [False, True]


FAKE_CHILD = """
import json, os, sys, time
builds = json.loads(sys.stdin.read())
while not os.path.exists(builds[0]["gate"]):
    time.sleep(0.01)
for index, _ in enumerate(builds):
    print(json.dumps({"index": index, "error": f"pid {os.getpid()}", "compiled": True}),
          flush=True)
"""


def test_builds_queued_while_a_child_runs_share_the_next_child(tmp_path, monkeypatch):
    monkeypatch.setattr(driver_builder, "_command", lambda: [sys.executable, "-c", FAKE_CHILD])
    gate = tmp_path / "gate"
    said: dict[str, str] = {}

    def build(name: str) -> driver_builder.DriverBuild:
        payload = {"gate": str(gate), "folder": str(tmp_path)}
        return driver_builder.DriverBuild(
            payload, None, None, lambda message: said.setdefault(name, message), f"@{name}"
        )

    # Builds another test left going would hold the builder thread while these queue up.
    assert driver_builder.wait_for_builds(timeout=120)
    first = build("first")
    driver_builder.submit(first)
    while not any(first in child.builds for child in list(driver_builder._running)):
        time.sleep(0.01)  # the first child has started, with the first build only
    driver_builder.submit(build("second"))
    driver_builder.submit(build("third"))
    gate.touch()
    assert driver_builder.wait_for_builds(timeout=60)
    assert said["second"] == said["third"] != said["first"], said


def test_stopped_builds_end_quietly_running_and_queued(tmp_path, monkeypatch):
    """stop_builds() (what the suite runs after each test) kills the running child and drops
    the queued build: each ends through on_stopped, none through on_failed (its warning would
    land in whatever test runs next), and nothing is left pending or running."""
    monkeypatch.setattr(driver_builder, "_command", lambda: [sys.executable, "-c", FAKE_CHILD])
    gate = tmp_path / "gate"  # never made: the child would wait forever
    failed: list[str] = []
    stopped: list[str] = []

    def build(name: str) -> driver_builder.DriverBuild:
        payload = {"gate": str(gate), "folder": str(tmp_path)}
        return driver_builder.DriverBuild(
            payload, None, None, failed.append, f"@{name}", on_stopped=lambda: stopped.append(name)
        )

    assert driver_builder.wait_for_builds(timeout=120)
    first = build("first")
    driver_builder.submit(first)
    while not any(first in child.builds for child in list(driver_builder._running)):
        time.sleep(0.01)
    child = next(c for c in driver_builder._running if first in c.builds)
    driver_builder.submit(build("second"))
    assert driver_builder.stop_builds(timeout=60) == 2
    assert sorted(stopped) == ["first", "second"] and failed == []
    assert driver_builder.pending() == 0 and not driver_builder._running
    assert child.process.poll() is not None  # the child is gone, reaped


def test_a_plan_whose_build_was_stopped_keeps_its_driver_and_its_values(tmp_path, monkeypatch):
    import warnings

    import numpy as np

    import backplan as bp
    from backplan.runtime.backend import use_backend

    monkeypatch.setenv("BACKPLAN_DRIVER", "background")
    monkeypatch.setenv("BACKPLAN_CACHE_DIR", str(tmp_path))
    rng = np.random.default_rng(3)
    w = bp.tensor(rng.standard_normal((5, 3)).astype(np.float32))
    x = bp.tensor(rng.standard_normal((23, 5)).astype(np.float32))

    def loss(w, x):
        return bp.mean(bp.tanh(x @ w) ** 2)

    step = bp.value_and_grad(bp.compile(loss))
    with use_backend("numba"):
        plan = step.trace(w, x).runner().compiled
        with driver_lock.held(plan.module_path), warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            first = step(w, x)
            assert driver_builder.pending() == 1
            assert driver_builder.stop_builds(timeout=60) == 1
            assert not plan.wait_for_driver(timeout=5)
            again = step(w, x)
        assert not [w_ for w_ in said if issubclass(w_.category, bp.DriverBuildWarning)]
    assert plan.driver_tier == "python" and "stopped" in plan.driver_error
    expected = bp.value_and_grad(loss)(w, x)  # the reference interpreter
    for got in (first, again):
        np.testing.assert_allclose(np.asarray(got[0]), np.asarray(expected[0]), rtol=1e-5)
        for g, e in zip(got[1], expected[1], strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-4, atol=1e-6)


def test_a_queued_build_compiles_where_its_plan_lives_after_the_cache_folder_changes(
    tmp_path, monkeypatch
):
    """A build queued behind another starts after the program pointed BACKPLAN_CACHE_DIR
    elsewhere (a test or a benchmark moving to a fresh cache): it still compiles into the folder
    its plan was loaded from, where the plan looks for it."""
    import numpy as np

    import backplan as bp
    from backplan.runtime.backend import use_backend

    monkeypatch.setenv("BACKPLAN_DRIVER", "background")
    monkeypatch.setenv("BACKPLAN_CACHE_DIR", str(tmp_path / "first"))
    w = bp.tensor(np.ones((5, 3), np.float32))
    x = bp.tensor(np.ones((19, 5), np.float32))
    one = bp.value_and_grad(bp.compile(lambda w, x: bp.mean(bp.tanh(x @ w) ** 2)))
    two = bp.value_and_grad(bp.compile(lambda w, x: bp.mean(bp.sin(x @ w) ** 2)))
    with use_backend("numba"):
        plans = [step.trace(w, x).runner().compiled for step in (one, two)]
        with driver_lock.held(plans[0].module_path):
            one(w, x)
            two(w, x)
            monkeypatch.setenv("BACKPLAN_CACHE_DIR", str(tmp_path / "second"))
        for plan in plans:
            assert plan.wait_for_driver(timeout=240), plan.driver_error


def test_a_build_by_other_code_generator_files_is_refused_with_the_reason(tmp_path, monkeypatch):
    """Code generator files edited after the program started (or another copy imported by the
    child) would key the compiled driver apart from the plan's: the build says so."""
    import numpy as np

    import backplan as bp
    from backplan.codegen.build import cache
    from backplan.runtime.backend import use_backend

    monkeypatch.setenv("BACKPLAN_DRIVER", "background")
    monkeypatch.setenv("BACKPLAN_CACHE_DIR", str(tmp_path / "kernels"))
    monkeypatch.setattr(cache, "codegen_fingerprint", lambda: "started-with-these")
    w = bp.tensor(np.ones((5, 3), np.float32))
    x = bp.tensor(np.ones((23, 5), np.float32))
    step = bp.value_and_grad(bp.compile(lambda w, x: bp.mean(bp.tanh(x @ w) ** 2)))
    with use_backend("numba"), pytest.warns(bp.DriverBuildWarning, match="other code generator"):
        step(w, x)
        plan = step.trace(w, x).runner().compiled
        assert not plan.wait_for_driver(timeout=240)
    assert plan.driver_tier == "python"


def test_non_contiguous_and_contiguous_numpy_arguments_share_the_built_driver(
    tmp_path, monkeypatch
):
    """NumPy arguments reach the plan read-only; a non-contiguous one is copied or, sliced, read
    in place through the span it covers, and the copy or span stays read-only, so the driver
    built for the first call serves every call (a writeable one was another argument type: the
    driver compiled again, inside the call)."""
    import numpy as np

    import backplan as bp
    from backplan.runtime.backend import use_backend

    monkeypatch.setenv("BACKPLAN_DRIVER", "background")
    monkeypatch.setenv("BACKPLAN_CACHE_DIR", str(tmp_path / "kernels"))
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 3))
    x = rng.standard_normal((8, 12))[:, ::2]
    labels = np.array([0, 1, 2, 0, 1, 2, 0, 1])
    step = bp.value_and_grad(bp.compile(lambda w, x, y: bp.cross_entropy(bp.tanh(x @ w), y)))
    with use_backend("numba"):
        first = step(w, x, labels)
        plan = step.trace(w, x, labels).runner().compiled
        assert plan.wait_for_driver(timeout=240), plan.driver_error
        step(w, x, labels)
        again = step(w, np.ascontiguousarray(x), labels)
        assert len(plan._run.overloads) == 1
    assert np.array_equal(again[1].numpy(), first[1].numpy())
    with use_backend("reference"):
        expected = bp.value_and_grad(lambda w, x, y: bp.cross_entropy(bp.tanh(x @ w), y))(
            w, x, labels
        )
    np.testing.assert_allclose(first[1].numpy(), expected[1].numpy(), rtol=1e-10)


def test_a_build_limited_to_one_cpu_takes_equal_turns_with_the_steps():
    """Pinned to one CPU (the child inherits the program's CPUs), a build at a lower priority
    got about a tenth of the CPU from a busy step loop; with several it leaves them to the steps."""
    from backplan.codegen.build import driver_build

    assert driver_build.niceness({3}) == 0
    assert driver_build.niceness({0, 1}) == driver_build.BUILD_NICENESS > 0
    assert driver_build.niceness(None) == driver_build.BUILD_NICENESS
