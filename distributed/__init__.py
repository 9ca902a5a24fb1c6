"""backplan.distributed: data-parallel training over MPI (mpi4py), with gradients exchanged in
buckets ordered by the static backward plan. Install with `pip install -e ".[mpi]"` and launch
with `mpiexec -n 2 python train.py`.

>>> import backplan.distributed as bpd  # doctest: +SKIP
>>> rank, size = bpd.init()  # doctest: +SKIP
>>> params = bpd.broadcast(params)  # doctest: +SKIP
>>> step = bpd.data_parallel(bp.value_and_grad(loss_fn))  # doctest: +SKIP
>>> loss, grads = step(params, bpd.shard(x, rank, size), bpd.shard(y, rank, size))  # doctest: +SKIP
"""

from .agreement import check_replicas
from .buckets import DEFAULT_BUCKET_BYTES, Bucket, ExchangedLeaf, plan_buckets
from .collectives import broadcast, shard
from .errors import (
    DistributedError,
    MPIUnavailableError,
    RankFailedError,
    RankMismatchError,
    RankOutOfStepError,
    RankTimeoutError,
    ReplicaMismatchError,
)
from .report import DataParallelReport
from .step import DataParallelStep, data_parallel
from .training import DataParallelTraining
from .world import World, init


def explain(step: DataParallelStep, *args, size: int | None = None, **kwargs):
    """The bucket schedule of a data-parallel step for these arguments; see
    DataParallelStep.explain."""
    return step.explain(*args, size=size, **kwargs)


__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "Bucket",
    "DataParallelReport",
    "DataParallelStep",
    "DataParallelTraining",
    "DistributedError",
    "ExchangedLeaf",
    "MPIUnavailableError",
    "RankFailedError",
    "RankMismatchError",
    "RankOutOfStepError",
    "RankTimeoutError",
    "ReplicaMismatchError",
    "World",
    "broadcast",
    "check_replicas",
    "data_parallel",
    "explain",
    "init",
    "plan_buckets",
    "shard",
]
