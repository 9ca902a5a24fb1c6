"""Errors of data-parallel training; all are BackplanErrors so one except clause catches them."""

from backplan.ir.errors import BackplanError

INSTALL_HINT = 'pip install -e ".[mpi]"'


class DistributedError(BackplanError, RuntimeError):
    """Ranks disagree about something that must be the same on all of them."""


class MPIUnavailableError(DistributedError, ImportError):
    """mpi4py or the MPI library it loads is missing; the message says what to install."""


class RankMismatchError(DistributedError, ValueError):
    """Ranks pass trees of different structure, shapes or dtypes; names the rank and the leaf."""


class ReplicaMismatchError(DistributedError):
    """Parameters that should be identical on every rank are not (check_replicas=True)."""


class RankTimeoutError(DistributedError, TimeoutError):
    """A rank did not reach a data-parallel step (or its exchange) within data_parallel's
    timeout; names the ranks not heard from. Uncaught, it ends every rank through MPI_Abort."""


class RankFailedError(DistributedError):
    """Another rank's call of the step raised after the ranks had agreed on the call; names
    the rank and its error. That rank completed the call's exchange without gradients, so no
    rank applied anything from the call and the step may be called again."""


class RankOutOfStepError(DistributedError):
    """This rank's earlier call raised where it could not complete the call's exchange (the
    compiled driver had started it); its collectives no longer pair with the other ranks'."""
