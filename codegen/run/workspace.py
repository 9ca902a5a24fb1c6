"""Per-call working memory of a compiled plan, safe under threads.

Kernels release the GIL, so two threads calling one compiled function run at once. Each call
checks out a workspace (the scratch arenas and the output buffers of that workspace's last two
calls) from a small pool and returns it afterwards: concurrent calls never share bytes, and a
single thread keeps reusing one warm workspace. Only launches of parallel kernels are
serialised, and only under Numba's workqueue threading layer, which aborts the process when
two threads enter it at once.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref

import numba
import numpy as np

from backplan.codegen.run.arena_memory import OFFERED, new_arena, take_offer
from backplan.codegen.run.blas_pool import BLAS_POOL
from backplan.codegen.run.free_cores import free_cores

KEEP_IDLE = 4  # workspaces kept per plan after a burst of concurrent calls
ALONE_BEFORE_TRIM = 8  # calls in a row with no other in flight before a burst's spares go
REUSE_BYTES = 1 << 16  # outputs at least this big are reused from the last two calls
# calls in a row that find both generations unheld before the older is let go: a loop that
# drops its results keeps one; a loop starting again from arrays it does not hold (a new
# epoch, a benchmark's batch) finds the older still there on its second call
IDLE_BEFORE_LETTING_GO = 2

# The threading layers Numba documents as safe to enter from several threads at once.
_THREADSAFE_LAYERS = ("tbb", "omp", "threadsafe")
_parallel_launch = threading.Lock()


def parallel_guard():
    """A lock around calls that launch parallel kernels, unless the layer is thread-safe."""
    if str(numba.config.THREADING_LAYER) in _THREADSAFE_LAYERS:
        return contextlib.nullcontext()
    return _parallel_launch


class SizedLaunch:
    """Around a call that runs BLAS products OpenBLAS may thread: holds `lock` (the workqueue
    layer's, parallel_guard, for plans with parallel kernels too) and sizes OpenBLAS's threads
    (a global, codegen/run/blas_pool.py) to the free cores (codegen/run/free_cores.py).

    Numba's count is left as it is. Measured in one process at load 11 on the 2-vCPU EPYC,
    both CPUs, five interleaved rounds (median ms): OpenBLAS sized and Numba kept: cnn 0.63,
    mlp 20.2, mlp_deep 44.3; both sized (parallel kernels serial when busy): 0.64, 33.2, 59.2,
    transformer 404; neither: 1.08, 79.0, 50.5, transformer 150. The own GEMM's blocks and
    prange loops are long enough to gain from the second core's share of a busy machine;
    OpenBLAS's threaded small products are not (its threads spin at the barrier)."""

    def __init__(self, lock=None, one_thread: bool = False):
        self._lock = lock
        self._one_thread = one_thread

    def __enter__(self):
        if self._lock is not None:
            self._lock.acquire()
        BLAS_POOL.limit(1 if self._one_thread else free_cores())
        return self

    def __exit__(self, *exc) -> None:
        if self._lock is not None:
            self._lock.release()


def sized_launch(parallel: bool, blas: bool, shares_gemm: bool = False):
    """The launch guard of a plan: the launch lock where parallel kernels need one, BLAS sized
    to the free cores where it calls threaded BLAS products; None when it needs neither.

    shares_gemm: the plan's large products share their rows with the GEMM's helper threads
    (gemm/team.py); its BLAS products, the small and narrow ones, then run on one thread.
    OpenBLAS threads a product above 262,144 multiply-adds per thread (mlp's 10-wide layer:
    128 x 10 x 512 on two) and its worker then spins, for far longer than a step, on the core
    the helper needs: mlp took 1.29x less time on two cores than on one where mlp_deep, whose
    narrow products are below the threshold, took 1.57x less (quiet box, BENCHMARKS.md 36)."""
    lock = parallel_guard() if parallel else None
    lock = None if isinstance(lock, contextlib.nullcontext) else lock
    if not blas:
        return lock
    return SizedLaunch(lock, one_thread=shares_gemm)


def arena_bytes(scratch: list[tuple[np.dtype, int]]) -> int:
    """Bytes of the one scratch arena that each (dtype, length) of `scratch` views."""
    return max((max(n, 1) * np.dtype(d).itemsize for d, n in scratch), default=0)


class Arena:
    """One raw scratch buffer, and the views of it each plan reading it uses: every dtype a
    plan places in its arena views the same bytes (ir/layout.py). The views are the arena's
    own, so an arena let go takes them with it, and a plan checking it out again finds them.
    A big arena lies in a reservation of address space (codegen/run/arena_memory.py):
    `reservation`, one a size switch freed, to grow over its pages."""

    __slots__ = ("raw", "nbytes", "reservation", "_views")

    def __init__(self, nbytes: int, reservation=None):
        if reservation is None:
            self.raw, self.reservation = new_arena(nbytes)
        else:
            self.raw, self.reservation = reservation.arena(nbytes), reservation
        self.nbytes = nbytes
        self._views: dict = {}

    def views(self, layout: Layout) -> list:
        """The arena seen as each (dtype, length) of a plan's scratch layout."""
        found = self._views.get(layout)
        if found is None:
            raw = self.raw
            found = [raw[: max(n, 1) * np.dtype(d).itemsize].view(d) for d, n in layout.scratch]
            self._views[layout] = found
        return found


class Layout:
    """A plan's scratch, (dtype, length) pairs, as a key of an Arena's views: hashed by
    identity (a tuple of dtypes hashes each dtype on every call's lookup)."""

    __slots__ = ("scratch",)

    def __init__(self, scratch: tuple):
        self.scratch = scratch


class _Spares:
    """A pool's idle items and the counts that let a burst's spares go: calls running at once
    each take one (made when none is idle), up to KEEP_IDLE stay for the next burst, and once
    ALONE_BEFORE_TRIM calls in a row ran with no other holding one, the spares go. list.pop and
    list.append are atomic under the GIL, so no lock: a race on the counts only delays or
    hastens freeing spares that no call holds."""

    def __init__(self):
        self._idle: list = []
        self._made = 0  # items held, idle or checked out
        self._alone = 0  # calls in a row that found every other item idle

    def _take(self):
        """An idle item, or None where the caller makes one (counted as made)."""
        idle = self._idle
        try:
            item = idle.pop()
        except IndexError:
            self._made += 1
            self._alone = 0
            return None
        if len(idle) + 1 < self._made:  # another call holds one now
            self._alone = 0
        elif idle:  # spares of a burst, and this call runs alone
            self._alone += 1
            if self._alone >= ALONE_BEFORE_TRIM:
                self._alone = 0
                self._drop(len(idle))
        return item

    def _put(self, item, keep: bool = True) -> None:
        if keep and len(self._idle) < KEEP_IDLE:
            self._idle.append(item)
        else:
            self._made -= 1

    def _drop(self, count: int) -> None:
        del self._idle[:count]
        self._made -= count


class ArenaPool(_Spares):
    """Scratch arenas checked out per call, one size: the largest any plan drawing from the pool
    needs. A compiled function's forward and the backward() that consumes its saved buffers
    draw from one pool (runtime/program.py): a call holds one arena while its plan runs and
    returns it, so the step holds max(forward, backward) scratch where two arenas of their own
    held the sum (ir/peak.py counts it so). Calls running at once each hold their own. An arena
    smaller than the pool's size (checked in while a larger plan joined) is let go, never
    handed out."""

    def __init__(self):
        super().__init__()
        self.nbytes = 0

    def need(self, nbytes: int) -> None:
        """A plan drawing from the pool needs `nbytes`: a larger size lets the idle arenas go
        and allocates one of it, as a plan of its own allocated its arena when it was made."""
        if nbytes > self.nbytes or not self._made:
            self.nbytes = max(nbytes, self.nbytes)
            self._drop(len(self._idle))
            self._idle.append(Arena(self.nbytes))
            self._made += 1

    def idle_arenas(self) -> list:
        return [a.raw for a in list(self._idle)]

    def release_idle(self) -> list:
        """Let go of the idle arenas; returns their reservations (a size switch offers them to
        the next size's arena, codegen/run/arena_memory.py)."""
        dropped = self._idle[:]
        self._drop(len(dropped))
        reservations = [a.reservation for a in dropped if a.reservation is not None]
        del dropped  # the arenas' views of the reservations go with them
        return reservations

    def checkout(self) -> Arena:
        idle = self._idle
        if len(idle) == 1 and self._made == 1 and not OFFERED:  # one call at a time: the
            try:  # usual case, without _take's counting (nothing to trim: no spare)
                arena = idle.pop()
            except IndexError:  # another thread took it meanwhile
                pass
            else:
                if arena.nbytes >= self.nbytes:
                    return arena
                self._made -= 1  # too small for a plan that joined since: let go
        while True:
            arena = self._take()
            if arena is None:
                return Arena(self.nbytes, take_offer(self.nbytes) if OFFERED else None)
            if arena.nbytes < self.nbytes:  # too small for a plan that joined since: let go
                self._made -= 1
                continue
            if OFFERED and arena.reservation is not None:  # a size switch freed arenas
                offered = take_offer(arena.nbytes)
                if offered is not None:  # grow over the freed pages rather than fault fresh ones
                    arena = Arena(arena.nbytes, offered)
            return arena

    def checkin(self, arena: Arena) -> None:
        if arena.nbytes >= self.nbytes and len(self._idle) < KEEP_IDLE:  # _put, inline
            self._idle.append(arena)
        else:
            self._made -= 1


class Workspace:
    """The outputs of this workspace's last two calls, and the scratch arena its call runs in,
    with its views as this plan's dtypes: the workspace's own for good, or a shared ArenaPool's
    while a call holds the workspace (WorkspacePool)."""

    def __init__(self, output_buffers: list, donatable=frozenset()):
        self.held = None  # the Arena its call runs in (its own, or a shared pool's)
        self.arena = None  # its raw bytes (the checked mode counts them)
        self.reservation = None  # its reservation of address space, if it lies in one
        self.scratch: list | tuple = ()  # its views as the plan's dtypes
        self.output_buffers = output_buffers  # (shape, dtype) of each per-call output
        self.previous_outputs = [None] * len(output_buffers)
        self.older_outputs = [None] * len(output_buffers)  # the call's before that
        self._idle_calls = [0] * len(output_buffers)  # calls in a row both stayed unheld
        self.donatable = donatable  # outputs that may go back in as donated inputs: not kept
        self._slots = [
            (i, shape, dtype, _reusable(shape, dtype) and i not in donatable)
            for i, (shape, dtype) in enumerate(output_buffers)
        ]
        self._any_reused = any(slot[3] for slot in self._slots)

    def output_arrays(self, given=()) -> list:
        """Fresh output buffers, except that a big buffer of this workspace's last two calls
        that nobody holds any more is reused: no new pages to fault in (16 MiB outputs cost
        ~1 ms each). Two generations, because a loop that rebinds its results
        (`p, s = update(g, s, p)`, `loss, grads = step(params, x)`) still holds the last call's
        while the next one runs: that call writes into the one before's, which the rebinding
        let go. A buffer anyone holds (a name, a view, a list of results) is never handed out:
        its reference count says so. Only the thread holding the workspace looks at them.
        Slots in `given` are left None: the caller fills them with donated inputs."""
        if not (given or self._any_reused):
            return [np.empty(shape, dtype) for shape, dtype in self.output_buffers]
        arrays = []
        previous_outputs, older_outputs = self.previous_outputs, self.older_outputs
        for i, shape, dtype, reusable in self._slots:
            if i in given:  # the caller's buffer: keep none of ours for this slot
                arrays.append(None)
                previous_outputs[i] = older_outputs[i] = None
            elif not reusable:
                arrays.append(np.empty(shape, dtype))
            else:
                previous = previous_outputs[i]
                if previous is not None and sys.getrefcount(previous) == 3:  # list, local, arg
                    previous.flags.writeable = True
                    arrays.append(previous)
                    older = older_outputs[i]
                    if older is not None and sys.getrefcount(older) == 3:  # idle too
                        self._idle_calls[i] += 1
                        if self._idle_calls[i] >= IDLE_BEFORE_LETTING_GO:
                            older_outputs[i] = None  # a loop that drops its results needs one
                            self._idle_calls[i] = 0
                    continue
                self._idle_calls[i] = 0
                older = older_outputs[i]
                if older is not None and sys.getrefcount(older) == 3:
                    older.flags.writeable = True  # the last call's stays next in line
                    older_outputs[i], previous_outputs[i] = previous, older
                    arrays.append(older)
                    continue
                del older  # held by the caller (or None): the workspace lets it go
                older_outputs[i] = previous
                previous = previous_outputs[i] = np.empty(shape, dtype)
                _keep_for_reuse(previous)
                arrays.append(previous)
        return arrays


# id -> weak reference of each output a workspace keeps to write again (arrays are unhashable);
# an entry leaves when its array dies. Only outputs of REUSE_BYTES or more are entered.
_kept_for_reuse: dict[int, weakref.ref] = {}


def _keep_for_reuse(array: np.ndarray) -> None:
    key = id(array)

    def gone(ref, key=key):
        if _kept_for_reuse.get(key) is ref:
            del _kept_for_reuse[key]

    _kept_for_reuse[key] = weakref.ref(array, gone)


def kept_only_for_reuse(array: np.ndarray) -> bool:
    """Whether nothing but a workspace holds `array` (besides the caller's one name): an output
    of a previous call that the next call writes into again, the same bytes as its output,
    not a result anyone keeps beside it (tracer/loop_watch.py counts it as let go)."""
    ref = _kept_for_reuse.get(id(array))
    if ref is None or ref() is not array:
        return False
    # the caller's name, this parameter, getrefcount's argument and the workspace's list
    return sys.getrefcount(array) <= 4


def reused_output_bytes(output_buffers, donatable=frozenset()) -> int:
    """Bytes of one generation of the outputs a workspace writes again ((shape, dtype) of each
    output buffer; donatable: those that go back in as donated inputs, never kept): what it
    keeps between calls beside the results the caller holds, to write the next call's into
    (Workspace.output_arrays)."""
    return sum(
        int(np.prod(shape)) * np.dtype(dtype).itemsize
        for i, (shape, dtype) in enumerate(output_buffers)
        if i not in donatable and _reusable(shape, dtype)
    )


def _reusable(shape, dtype) -> bool:
    """Worth reusing: below REUSE_BYTES, np.empty is cheaper than the checks (it takes memory
    from the allocator's free lists, no page faults)."""
    return int(np.prod(shape)) * np.dtype(dtype).itemsize >= REUSE_BYTES


class WorkspacePool(_Spares):
    """Workspaces checked out per call; list.pop and list.append are atomic under the GIL, so
    the pool needs no lock of its own.

    Calls running at once each hold a workspace, and up to KEEP_IDLE stay for the next burst;
    once ALONE_BEFORE_TRIM calls in a row ran with no other call holding one, the spares go
    (_Spares), so a loop in one thread after concurrent calls holds one arena and its kept
    outputs again, as explain counts (four arenas of a 3,001-row MLP kept 296 MB beyond its
    86 MB for good).

    arenas: the ArenaPool its calls draw their scratch from while they run, shared with the
    plans that never run inside one of its calls (a forward and the backward() consuming it);
    None: each workspace keeps an arena of its own, for good (no pool to go through: a call
    of a small joint step is ~30 us). A plan with no scratch holds none."""

    def __init__(
        self,
        scratch: list[tuple[np.dtype, int]],
        output_buffers: list,
        donatable=frozenset(),
        arenas: ArenaPool | None = None,
    ):
        self._scratch = tuple((np.dtype(d), n) for d, n in scratch)
        self._layout = Layout(self._scratch)
        self._output_buffers = output_buffers
        self._donatable = donatable
        self._arenas = arenas if self._scratch else None
        if self._arenas is not None:
            self._arenas.need(arena_bytes(scratch))
        super().__init__()
        self._idle.append(self._new_workspace())
        self._made = 1

    def _new_workspace(self, reservation=None) -> Workspace:
        """A workspace, with an arena of its own unless its calls draw from a shared pool.
        reservation: one a size switch freed, to build that arena over its pages."""
        workspace = Workspace(self._output_buffers, self._donatable)
        if self._scratch and self._arenas is None:
            _attach(workspace, Arena(self.scratch_bytes, reservation), self._layout)
        return workspace

    @property
    def scratch_bytes(self) -> int:
        """Bytes of this plan's own scratch (each concurrent call holds an arena at least as
        big: arena_bytes, a shared pool's size)."""
        return arena_bytes(self._scratch)

    @property
    def arena_bytes(self) -> int:
        """Bytes of the arena a call of this plan holds: its shared pool's size, the largest
        scratch of the plans sharing it, or its own scratch (0 without scratch)."""
        return self.scratch_bytes if self._arenas is None else self._arenas.nbytes

    def idle_arenas(self) -> list:
        """The arenas no call holds now (a shared pool's: every plan drawing from it)."""
        if self._arenas is not None:
            return self._arenas.idle_arenas()
        return [w.arena for w in list(self._idle) if w.arena is not None]

    def release_idle(self) -> list:
        """Let go of the workspaces no call holds (their kept outputs and own arenas are freed
        once nothing else holds them) and of the idle arenas of its shared pool (every plan
        drawing from it); the next call makes new ones. A dynamic axis's other sizes do this
        when a call switches size (tracer/dynamic.py), so that a call holds its own size's
        arenas alone, as explain's per-size peak counts. Returns the reservations of the arenas
        let go, which the switch offers to the next size's arena."""
        dropped = self._idle[:]
        self._drop(len(dropped))
        if self._arenas is not None:
            return self._arenas.release_idle()
        reservations = [w.reservation for w in dropped if w.reservation is not None]
        del dropped  # the workspaces' views of the reservations go with them
        return reservations

    def checkout(self) -> Workspace:
        idle = self._idle
        workspace = None
        if len(idle) == 1 and self._made == 1:  # one call at a time: no spare to count
            try:
                workspace = idle.pop()
            except IndexError:  # another thread took it meanwhile
                pass
        if workspace is None:
            workspace = self._take()
        arenas = self._arenas
        if arenas is not None:  # _attach, inline: two plans' calls a step go through here
            if workspace is None:
                workspace = Workspace(self._output_buffers, self._donatable)
            arena = workspace.held = arenas.checkout()
            workspace.arena, workspace.reservation = arena.raw, arena.reservation
            views = arena._views.get(self._layout)
            workspace.scratch = arena.views(self._layout) if views is None else views
        elif workspace is None:
            offered = take_offer(self.scratch_bytes) if OFFERED and self._scratch else None
            workspace = self._new_workspace(offered)
        elif OFFERED and workspace.reservation is not None:  # a size switch freed arenas
            offered = take_offer(workspace.arena.nbytes)
            if offered is not None:  # grow over the freed pages rather than fault in fresh ones
                workspace = self._new_workspace(offered)
        return workspace

    def checkin(self, workspace: Workspace) -> None:
        arenas = self._arenas
        if arenas is not None:  # the arena goes back to its pool: the workspace keeps no view
            arenas.checkin(workspace.held)
            workspace.held = workspace.arena = workspace.reservation = None
            workspace.scratch = ()
        if len(self._idle) < KEEP_IDLE:  # _put, inline: every call goes through here
            self._idle.append(workspace)
        else:
            self._made -= 1


def _attach(workspace: Workspace, arena: Arena, layout: Layout) -> None:
    """The workspace's call runs in `arena`, seen as the plan's dtypes."""
    workspace.held = arena
    workspace.arena, workspace.reservation = arena.raw, arena.reservation
    workspace.scratch = arena.views(layout)
