"""The MPI world: which rank this process is, how many there are, and what happens when one of
them fails. mpi4py is imported only here, and only when init() is called, so backplan itself
never needs it."""

from __future__ import annotations

import os
import sys
import time
import traceback
from dataclasses import dataclass

from .errors import INSTALL_HINT, MPIUnavailableError

# MPI_Abort kills every rank at once, and mpiexec can drop what a rank wrote to stderr just before
# (its forwarder had not read the pipe yet): the message is worth more than half a second.
ABORT_GRACE_S = 0.5


@dataclass(frozen=True)
class World:
    """This process's rank, the number of ranks and the mpi4py communicator;
    `rank, size = bpd.init()` unpacks the first two."""

    rank: int
    size: int
    comm: object = None

    def __iter__(self):
        return iter((self.rank, self.size))


_state: dict = {}


def init(comm=None) -> World:
    """Start MPI (once) and return this process's rank and the number of ranks.

    Launch the script with `mpiexec -n 2 python train.py`; without mpiexec it is one rank.
    With more than one rank, an exception that nobody catches on any rank is printed with
    that rank's number and ends every rank through MPI_Abort, so no rank waits forever in a
    collective for one that died.

    >>> import backplan.distributed as bpd
    >>> rank, size = bpd.init()  # doctest: +SKIP
    """
    world = _state.get("world")
    if world is not None and (comm is None or comm is world.comm):
        return world
    if comm is None:
        comm = _mpi().COMM_WORLD
    world = World(comm.Get_rank(), comm.Get_size(), comm)
    _state["world"] = world
    if world.size > 1:
        _install_abort_on_error(world)
    return world


def current_world() -> World | None:
    """The world init() made, or None before init()."""
    return _state.get("world")


def mpi_module():
    """The mpi4py MPI module (for ops and IN_PLACE); init() must have succeeded."""
    return _mpi()


# MPICH's non-blocking allreduce on 2 ranks, picked before MPI starts (mpi4py's import starts
# it): recursive doubling, each rank sending its whole bucket to the other once and adding the
# two, in place of the reduce-scatter + all-gather MPICH picks for buckets of 2 MiB, whose two
# rounds each need both ranks running. The bench mlp's step on 2 ranks spent 3.53-3.71 ms CPU
# per call against 4.46-4.55 (load 17, BENCHMARKS.md 35); the two sums are the same floats in
# either order, so every rank still gets the same bits. Set the variable to choose another
# (MPIR_CVAR_IALLREDUCE_INTRA_ALGORITHM=auto: MPICH's own choice); other MPIs ignore it.
ALLREDUCE_ALGORITHM = ("MPIR_CVAR_IALLREDUCE_INTRA_ALGORITHM", "sched_recursive_doubling")


def _choose_algorithms() -> None:
    """Set ALLREDUCE_ALGORITHM unless the user did, for a job of 2 ranks launched by a
    process manager that says its size (PMI_SIZE: MPICH's hydra), before MPI starts."""
    if "mpi4py.MPI" in sys.modules or os.environ.get("PMI_SIZE") != "2":
        return
    os.environ.setdefault(*ALLREDUCE_ALGORITHM)


def sums_by_recursive_doubling(size: int) -> bool:
    """Whether a job of `size` ranks runs its non-blocking allreduces by recursive doubling
    (ALLREDUCE_ALGORITHM: MPI then holds a receive buffer the size of each bucket in flight):
    2 ranks, the variable not set otherwise, and MPICH (assumed before MPI starts: the [mpi]
    extra's)."""
    name, algorithm = ALLREDUCE_ALGORITHM
    if size != 2 or os.environ.get(name, algorithm) != algorithm:
        return False
    if "mpi4py.MPI" in sys.modules:
        return sys.modules["mpi4py.MPI"].get_vendor()[0] == "MPICH"
    return True


def _mpi():
    _choose_algorithms()
    try:
        from mpi4py import MPI
    except ImportError as error:
        raise MPIUnavailableError(
            f"backplan.distributed needs mpi4py and an MPI library ({error}); install both "
            f"with `{INSTALL_HINT}` (mpi4py and the mpich wheel), or see docs/data-parallel.md "
            "('Which MPI') to use your cluster's own MPI"
        ) from error
    except RuntimeError as error:  # mpi4py found no libmpi to load
        raise MPIUnavailableError(
            f"mpi4py could not load an MPI library ({error}); install one with "
            f"`{INSTALL_HINT}` or load your cluster's MPI module"
        ) from error
    return MPI


def _install_abort_on_error(world: World) -> None:
    """An uncaught exception on one rank prints it with the rank and aborts all ranks."""
    previous = sys.excepthook

    def abort_all(kind, error, tb):
        message = "".join(traceback.format_exception(kind, error, tb))
        sys.stderr.write(
            f"{message}backplan.distributed: rank {world.rank} of {world.size} raised "
            f"{kind.__name__}: {error}\n  aborting all {world.size} ranks (MPI_Abort)\n"
        )
        sys.stderr.flush()
        time.sleep(ABORT_GRACE_S)
        try:
            world.comm.Abort(1)
        except BaseException:
            previous(kind, error, tb)

    sys.excepthook = abort_all
