"""Which executor runs compiled functions' plans: Numba-compiled kernels (the default) or the
NumPy reference interpreter (BACKPLAN_BACKEND=reference, or `use_backend("reference")`).
Eager one-op regions always use the reference interpreter: one NumPy call is already the best
kernel for one op, and compiling per op would cost more than it saves."""

from __future__ import annotations

import os
import threading
import warnings
import weakref
from contextlib import contextmanager

import numpy as np

from backplan.codegen.run import memory_check
from backplan.codegen.run.arena_memory import offer, withdraw_offers
from backplan.ir.gc_pause import paused_gc
from backplan.ir.interpreter import run_plan
from backplan.ir.liveness import OWNED_ROLES, Plan
from backplan.ir.lowering import LoweredPlan, let_go, lower
from backplan.ir.reference_storage import array_root

BACKENDS = ("numba", "reference")
_override: list[str] = []  # use_backend: the whole process (threads a test starts included)


def offer_arenas(reservations) -> None:
    """A size switch offers the arenas it freed to the next size's (codegen/run/arena_memory)."""
    offer(reservations)


def withdraw_arena_offers() -> None:
    """The offers a call did not take are dropped at its end."""
    withdraw_offers()


class _ThisThread(threading.local):
    """backend_in_this_thread's choice for the calling thread. The class default answers a
    thread that never chose: getattr(local, "name", None) raised and caught an AttributeError
    (its message formatted) on every compiled call, ~1% of a small step's instructions."""

    name: str | None = None


_this_thread = _ThisThread()  # backend_in_this_thread: the calling thread only


_DEFAULT = os.environ.get("BACKPLAN_BACKEND") or "numba"  # read once: calls are hot


# backend_in_this_thread blocks open now, in any thread: while there are none, current_backend
# does not read the thread's own choice (a threading.local read: ~500 instructions a call)
_thread_choices = 0
_thread_choices_lock = threading.Lock()


def current_backend() -> str:
    if _thread_choices:
        mine = _this_thread.name
        if mine is not None:
            return mine
    if _override:
        return _override[-1]
    if _DEFAULT not in BACKENDS:
        raise ValueError(f"BACKPLAN_BACKEND={_DEFAULT!r}; use one of {BACKENDS}")
    return _DEFAULT


@contextmanager
def use_backend(name: str):
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; use one of {BACKENDS}")
    _override.append(name)
    try:
        yield
    finally:
        _override.pop()


@contextmanager
def backend_in_this_thread(name: str):
    """use_backend for the calling thread alone: a report planning its frontier for its own
    backend must not switch the backend of the steps other threads run meanwhile."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; use one of {BACKENDS}")
    global _thread_choices
    with _thread_choices_lock:
        _thread_choices += 1
    before = _this_thread.name
    _this_thread.name = name
    try:
        yield
    finally:
        _this_thread.name = before
        with _thread_choices_lock:
            _thread_choices -= 1


class ReferenceRunner:
    backend = "reference"
    driver_tier = "reference"

    def __init__(self, plan: Plan, why: str | None = None):
        self.plan = plan
        self.why = why
        self.kernels = None

    def __call__(self, args: list, release=None, donate=()) -> list:
        return interpret(self.plan, args, release)

    def release_idle(self) -> list:
        """Nothing is kept between calls: every buffer is the call's own."""
        return []

    def wait_until_compiled(self, timeout: float | None = None) -> bool:
        return False  # nothing is building: its calls stay on the reference interpreter


def interpret(plan: Plan, args: list, release=None) -> list:
    """One call of the plan on the reference interpreter; the checked mode counts each buffer
    it allocates."""
    caller = _CallerArrays(args)  # weakly: a saved input is freed inside the call
    on_step = _counting(plan, caller) if memory_check.checking() else None
    outputs = run_plan(plan, args, release=release, on_step=on_step)
    for array in outputs:
        if array.base is not None and not caller.owns(array_root(array)):
            array.flags.writeable = False  # a view of our own buffer: wrapped, not copied
    return outputs


class _CallerArrays:
    """The buffers of a call's arguments, held weakly (the call may free them)."""

    def __init__(self, arrays: list):
        self._refs = {}
        for array in arrays:
            if isinstance(array, np.ndarray):
                root = array_root(array)
                self._refs[id(root)] = weakref.ref(root)

    def owns(self, root: np.ndarray) -> bool:
        ref = self._refs.get(id(root))
        return ref is not None and ref() is root


def _counting(plan: Plan, caller: _CallerArrays):
    """The checked mode on the reference interpreter: each buffer a step allocates (a view's
    base, once) goes through the counting allocator, held until NumPy frees it."""
    for name, array in plan.graph.constants.items():
        memory_check.ALLOCATOR.use(array, f"const {name}")
    constants = {id(array_root(a)) for a in plan.graph.constants.values()}
    nodes = plan.graph.nodes

    def on_step(step: int, env: dict) -> None:
        root = array_root(env[nodes[step]])
        if id(root) not in constants and not caller.owns(root):
            memory_check.ALLOCATOR.use(root, f"{nodes[step].op} (step {step})")

    return on_step


class CompiledRunner:
    """Runs the compiled plan; owned inputs (saved buffers, cotangents) are released when the
    call returns: inside it, their storage was already reused after its last read."""

    backend = "numba"

    def __init__(self, lowered: LoweredPlan, background: bool | None = None, arenas=None):
        from backplan.codegen.run.compiled import CompiledPlan

        plan = self.plan = lowered.plan
        self.compiled = CompiledPlan(lowered, background, arenas)
        self.kernels = self.compiled.kernel_count
        self._owned = [i for i, v in enumerate(plan.graph.inputs) if v.role in OWNED_ROLES]
        self._owns_all = len(self._owned) == len(plan.graph.inputs)  # a backward plan's case

    def __call__(self, args: list, release=None, donate=()) -> list:
        if self.compiled.driver_tier == "reference":  # the kernels build in the background
            return self._while_building(args, release)
        outputs = self.compiled(args, donate)
        if release is not None:
            every = getattr(release, "every", None) if self._owns_all else None
            if every is not None:
                every()
            else:
                for i in self._owned:
                    release(i)
        return outputs

    def _while_building(self, args: list, release) -> list:
        """A call while the kernels build: the reference interpreter runs the plan as a
        ReferenceRunner would (saved inputs freed after their last read, each buffer counted
        in the checked mode), the compiled plan's arena held meanwhile (counted too)."""
        plan = self.compiled.stand_in(args)
        if memory_check.checking():
            self.compiled.count_kept()
        return interpret(plan, args, release)

    @property
    def driver_tier(self) -> str:
        return self.compiled.driver_tier

    def release_idle(self) -> list:
        """Free the scratch arenas no call holds now (WorkspacePool.release_idle); returns
        their reservations."""
        return self.compiled.release_idle()

    def load_driver(self, args: list, donate=()) -> bool:
        """Load the cached compiled driver for these arguments without a call (see
        CompiledPlan.load_driver)."""
        return self.compiled.load_driver(args, donate)

    def wait_until_compiled(self, timeout: float | None = None) -> bool:
        return self.compiled.wait_for_driver(timeout)


def make_runner(
    lowered: LoweredPlan,
    backend: str | None = None,
    background: bool | None = None,
    arenas=None,
):
    """The runner of a lowered plan on this backend (the current one by default); a consuming
    backward's lowered plan may reuse private saved buffers after their last read, a forward's
    writes outputs into the inputs its plan donates (`lowered.donations`). background: the
    function's bp.compile(background=...), None for BACKPLAN_DRIVER's. arenas: a
    codegen/run/workspace.py ArenaPool a compiled plan draws its scratch from, shared with
    other plans (None: its own)."""
    plan = lowered.interpreted or lowered.plan  # NumPy copies a strided reshape itself
    backend = backend or current_backend()
    if backend == "reference":
        return ReferenceRunner(plan)
    from backplan.codegen.build.cache_signing import user_stacklevel
    from backplan.codegen.render.opaque import Unsupported

    try:
        return CompiledRunner(lowered, background, arenas)
    except Unsupported as exc:
        warnings.warn(  # at the user's call, not at backplan's line that made the runner
            f"graph @{plan.graph.name} runs on the reference interpreter: {exc}",
            stacklevel=user_stacklevel(),
        )
        return ReferenceRunner(plan, why=str(exc))


def runner_for(plan: Plan, runners: dict, background: bool | None = None):
    """plan's runner for the backend current now (use_backend switches between calls), kept
    in `runners` by backend; made once even when two threads ask at the same time."""
    backend = current_backend()
    found = runners.get(backend)
    if found is None:
        with _making_runner:
            found = runners.get(backend)
            if found is None:
                with paused_gc():  # ir/gc_pause.py: lowering's objects are no garbage
                    lowered = lower(plan)
                    if plan.shared is not None:  # a size of a symbolic plan (ir/symbolic.py)
                        found = make_runner(lowered, backend, background=background)
                if found is None:  # loop kernels may compile here: cycles are collected
                    found = make_runner(lowered, backend, background=background)
                runners[backend] = found
                let_go(plan)  # a later size keeps no lowering once it runs (ir/lowering.py)
    return found


_making_runner = threading.Lock()
