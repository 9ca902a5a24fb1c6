"""A cached function compiles in one process at a time (codegen/build/compile_lock.py): a
process that finds another compiling the same function and signature waits for it, then loads
what it saved instead of compiling it again (MPI ranks started together each compiled every
library function and inline driver of their plans)."""

import os
import subprocess
import sys
import threading
import time

import numba
import pytest
from numba import types

from backplan.codegen.build import compile_lock

MODULE = """
from backplan.codegen.jit import compiled_njit


@compiled_njit(cache=True)
def twice(x):
    return 2 * x


@compiled_njit(cache=True)
def untypable(x):
    return x.no_such_attribute
"""

WAITER = """
import importlib.util, sys
from backplan.codegen.build import compile_lock
taken = compile_lock.take
def take(path):
    waited = taken(path)
    print("waited", waited, flush=True)
    return waited
compile_lock.take = take
spec = importlib.util.spec_from_file_location("library_like", sys.argv[1])
module = sys.modules["library_like"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
print("calling", flush=True)
assert module.twice(21) == 42
print("misses", sum(module.twice.stats.cache_misses.values()), flush=True)
print("hits", sum(module.twice.stats.cache_hits.values()), flush=True)
"""


def _load(path, monkeypatch, name="twice"):
    """The module as a fresh process has it (importable by name: the saved code refers to it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("library_like", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "library_like", module)
    spec.loader.exec_module(module)
    return getattr(module, name)


def test_a_process_finding_the_function_compiling_elsewhere_loads_what_was_saved(
    tmp_path, monkeypatch
):
    """This process holds twice(int64)'s lock, as a compiling process does; a second process
    calling twice(21) waits instead of compiling, and once this one has compiled and saved it
    (which releases the lock) loads the saved code: no compile of its own."""
    path = tmp_path / "library_like.py"
    path.write_text(MODULE)
    twice = _load(path, monkeypatch)
    cache = twice._cache._cache()
    lock = compile_lock.lock_path(cache._cache_path, cache._impl.filename_base, (types.int64,))
    assert not compile_lock.take(lock)  # nobody held it
    waiter = subprocess.Popen(
        [sys.executable, "-c", WAITER, str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert waiter.stdout.readline() == "calling\n"
        time.sleep(1.0)  # the waiter is in its call by now (it passes either way if not)
        assert twice(21) == 42 and sum(twice.stats.cache_misses.values()) == 1
        assert lock not in compile_lock._held  # saving released it
        out, _ = waiter.communicate(timeout=120)
    finally:
        waiter.kill()
        compile_lock.release(lock)
    assert waiter.returncode == 0, out
    assert "misses 0" in out and "hits 1" in out, out


def test_a_lock_held_by_another_process_is_waited_for_and_then_taken(tmp_path):
    """take() says whether it waited: False when free or held by this process already, True
    when another process held it first (its compile may be in the cache now)."""
    lock = str(tmp_path / "f.lock")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from backplan.codegen.build import compile_lock\n"
            "compile_lock.take(sys.argv[1]); print('held', flush=True); time.sleep(0.5)",
            lock,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        assert compile_lock.take(lock)  # waited for the holder to exit
        assert not compile_lock.take(lock)  # this process holds it: no wait, no deadlock
    finally:
        holder.kill()
        holder.wait()
        compile_lock.release(lock)
    assert lock not in compile_lock._held
    assert not compile_lock.take(lock)
    compile_lock.release(lock)


def test_a_compile_that_raises_lets_its_lock_go(tmp_path, monkeypatch):
    """A typing error saves nothing: the lock it took on its cache miss is released as the
    compile raises, so no other process waits WAIT_S for a compile that will never be saved."""
    path = tmp_path / "library_like.py"
    path.write_text(MODULE)
    untypable = _load(path, monkeypatch, "untypable")
    held = set(compile_lock._held)
    with pytest.raises(numba.core.errors.TypingError, match="no_such_attribute"):
        untypable(1)
    assert set(compile_lock._held) == held
    assert not list(tmp_path.glob("__pycache__/*.lock"))


def test_looking_in_the_cache_takes_no_lock(tmp_path, monkeypatch):
    """load_cached only looks: a miss there is often compiled by a build process, or by
    another rank, which must not wait WAIT_S for a lock this process holds and never uses."""
    from backplan.codegen.jit import load_cached

    path = tmp_path / "library_like.py"
    path.write_text(MODULE)
    twice = _load(path, monkeypatch)
    held = dict(compile_lock._held)
    assert not load_cached(twice, (types.int64,))
    assert compile_lock._held == held  # before: held until this process exited


HOLDER = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("compile_lock", sys.argv[2])
compile_lock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compile_lock)  # alone: a holder up in milliseconds, not seconds
compile_lock.take(sys.argv[1]); print("held", flush=True)
sys.stdin.readline()
compile_lock.release(sys.argv[1]); compile_lock.take(sys.argv[1]); print("again", flush=True)
sys.stdin.readline()
"""


def _holder(lock: str, text: bool = True) -> subprocess.Popen:
    """A process running HOLDER on `lock`: it prints "held" once it holds the lock; each line
    written to its stdin moves it on (release and take again, then exit)."""
    return subprocess.Popen(
        [sys.executable, "-c", HOLDER, lock, compile_lock.__file__],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=text,
    )


def test_a_waiter_whose_lock_file_was_removed_waits_for_the_new_one(tmp_path):
    """A waiter opened the file before its holder removed it on release; a newcomer (here the
    holder itself) made a new file and holds it. The waiter's lock on the removed file guards
    nothing: it waits for the file at the path instead, so two never compile at once."""
    lock = str(tmp_path / "f.lock")
    holder = _holder(lock)
    waited = []
    try:
        assert holder.stdout.readline() == "held\n"
        waiter = threading.Thread(target=lambda: waited.append(compile_lock.take(lock)))
        waiter.start()
        time.sleep(0.3)  # the waiter has opened the first file and polls its lock
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline() == "again\n"
        holder.stdin.close()  # the holder exits: its lock on the new file goes
        waiter.join(timeout=60)
        assert waited == [True]
        assert os.fstat(compile_lock._held[lock]).st_ino == os.stat(lock).st_ino
    finally:
        holder.kill()
        holder.wait()
        compile_lock.release(lock)


def test_a_holder_killed_with_sigkill_leaves_its_file_and_no_wait(tmp_path):
    """The system releases a dead holder's flock: the next process takes the lock at once,
    on the file the dead one left, and removes it when done."""
    lock = str(tmp_path / "f.lock")
    holder = _holder(lock, text=False)
    assert holder.stdout.readline() == b"held\n"
    holder.kill()
    holder.wait()
    assert os.path.exists(lock)
    assert not compile_lock.take(lock)  # no holder left: no wait
    compile_lock.release(lock)
    assert not os.path.exists(lock)


def test_no_flock_or_no_file_compiles_without_the_lock(tmp_path, monkeypatch):
    """A file system without flock (ENOLCK), a lock file left unreadable or a folder that
    cannot be written: take() neither raises nor holds anything, and the caller compiles."""
    import errno
    import fcntl

    lock = str(tmp_path / "f.lock")

    def no_flock(fd, how):
        raise OSError(errno.ENOLCK, "No locks available")

    with monkeypatch.context() as patched:
        patched.setattr(fcntl, "flock", no_flock)
        compile_lock.take(lock)
    assert lock not in compile_lock._held
    if os.geteuid() == 0:
        return  # root opens any file
    os.chmod(lock, 0)
    assert not compile_lock.take(lock) and lock not in compile_lock._held
    folder = tmp_path / "read-only"
    folder.mkdir(mode=0o500)
    assert not compile_lock.take(str(folder / "f.lock"))
    assert str(folder / "f.lock") not in compile_lock._held


def test_a_child_forked_while_the_lock_is_held_does_not_keep_it(tmp_path):
    """A process forked while this one compiles (a thread starting worker processes) shares
    the lock file's descriptor: once this one releases, a process waiting on that file must
    get it, not wait until the child exits."""
    lock = str(tmp_path / "f.lock")
    assert not compile_lock.take(lock)
    waiting = os.open(lock, os.O_RDWR)  # as a waiter opened it before the release
    ready, tell = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child only sleeps
        os.write(tell, b"x")  # its fork handlers have run
        time.sleep(30)
        os._exit(0)
    try:
        assert os.read(ready, 1) == b"x"
        compile_lock.release(lock)
        import fcntl

        fcntl.flock(waiting, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raised before: the child held it
    finally:
        os.kill(child, 9)
        os.waitpid(child, 0)
        for fd in (waiting, ready, tell):
            os.close(fd)


def _compile_lines_shown(monkeypatch) -> None:
    """The compile line printed after 0.1 s, as in a terminal with no quiet setting."""
    from backplan.codegen.build import compile_notice

    monkeypatch.setenv("BACKPLAN_PROGRESS_SECONDS", "0.1")
    monkeypatch.delenv("BACKPLAN_QUIET", raising=False)
    monkeypatch.delenv("BACKPLAN_VERBOSE", raising=False)
    monkeypatch.setattr(compile_notice, "_said", [False])


def test_a_long_wait_names_the_process_it_waits_for(tmp_path, monkeypatch, capsys):
    """A holder stopped or stuck is waited for up to WAIT_S: the process's compile line
    (compile_notice) says so, with the holder's pid, instead of a silent pause."""
    _compile_lines_shown(monkeypatch)
    lock = str(tmp_path / "twice-5.py311.0123.lock")
    holder = _holder(lock)
    try:
        assert holder.stdout.readline() == "held\n"
        threading.Timer(1.0, holder.kill).start()  # stuck for a second, then gone
        assert compile_lock.take(lock)
    finally:
        holder.kill()
        holder.wait()
        compile_lock.release(lock)
    err = capsys.readouterr().err
    assert f"twice (process {holder.pid} compiles it; this one waits up to 300 s" in err, err


def test_the_wait_is_set_by_an_environment_variable(tmp_path, monkeypatch, capsys):
    """BACKPLAN_COMPILE_LOCK_WAIT_SECONDS bounds the wait for a holder that never lets go: the
    waiter gives up while the holder still holds the lock and compiles without it (take() says
    it waited; the lock is not this process's), and its compile line names the setting's wait.
    A value that is not a number keeps WAIT_S."""
    monkeypatch.setenv("BACKPLAN_COMPILE_LOCK_WAIT_SECONDS", "x")
    assert compile_lock.wait_seconds() == compile_lock.WAIT_S
    monkeypatch.setenv("BACKPLAN_COMPILE_LOCK_WAIT_SECONDS", "0.3")
    _compile_lines_shown(monkeypatch)
    lock = str(tmp_path / "stuck-5.py311.0123.lock")
    holder = _holder(lock)
    try:
        assert holder.stdout.readline() == "held\n"
        assert compile_lock.take(lock)  # gave up waiting
        assert holder.poll() is None and lock not in compile_lock._held
    finally:
        holder.kill()
        holder.wait()
    err = capsys.readouterr().err
    assert f"stuck (process {holder.pid} compiles it; this one waits up to 0.3 s" in err, err


def test_a_failed_compile_lets_only_its_own_signature_go(tmp_path, monkeypatch):
    """A compile of untypable(int64) that raises while the same function's float64 compile
    holds its lock (a nested compile, as typing tries one) releases its own lock only."""
    path = tmp_path / "library_like.py"
    path.write_text(MODULE)
    untypable = _load(path, monkeypatch, "untypable")
    cache = untypable._cache._cache()
    outer = compile_lock.lock_path(cache._cache_path, cache._impl.filename_base, (types.float64,))
    assert not compile_lock.take(outer)
    untypable._cache._locks[str((types.float64,))] = outer
    try:
        with pytest.raises(numba.core.errors.TypingError, match="no_such_attribute"):
            untypable(1)
        assert outer in compile_lock._held  # before: released with the int64 compile's
    finally:
        untypable._cache.release_locks()
    assert outer not in compile_lock._held
