"""explain() of a data-parallel step: the buckets, when each allreduce may start, when it does
start and where it is waited on, and the bytes each rank sends."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, replace

from backplan.ir.types import np_dtype

from . import shared_exchange, window_views
from .buckets import Bucket, ring_bytes_sent
from .half_sum import sent_in_16_bits
from .half_wire import summed_bytes
from .layout import Layout
from .shared_exchange import bytes_read


@dataclass(frozen=True)
class BucketRow:
    """One bucket as explain() reports it; steps are joint-plan steps (s0, s1, ...)."""

    index: int
    leaves: tuple[str, ...]
    dtype: str
    nbytes: int
    ready_step: int  # the step that writes its last leaf: the allreduce could start after it
    ready_text: str
    start_step: int  # when it does start: before this step (plan_steps: after the call)
    steps_after_ready: int  # plan steps left after ready_step, compute a split plan could hide
    bytes_sent: int  # per rank, ring allreduce
    calls_in_flight: int | None = None  # started inside the call: driver calls run meanwhile


class DataParallelReport:
    """Fields: `buckets` (BucketRow), `size`, `bucket_bytes`, `plan_steps`, `bytes_per_step`
    (allreduced per rank per exchange), `bytes_sent_per_step` and `accumulate` (calls per
    exchange); print() shows them as a table."""

    def __init__(
        self,
        layout: Layout,
        size: int,
        bucket_bytes: int,
        split: bool = False,
        accumulate=1,
        in_plan: dict | None = None,
    ):
        self.layout = layout
        # bucket index -> (plan step its allreduce starts after, driver calls while in flight),
        # for the buckets the compiled driver starts itself (distributed/in_plan.py)
        self.in_plan = in_plan or {}
        self.accumulate = accumulate
        self.split = split
        self.size = size
        self.bucket_bytes = bucket_bytes
        self.plan_steps = layout.plan_steps
        self.buckets = [self._row(b) for b in layout.buckets]
        self.bytes_per_step = sum(b.nbytes for b in self.buckets)
        self.bytes_sent_per_step = sum(b.bytes_sent for b in self.buckets)
        self.optimizer: str | None = None
        self.state_bytes_per_rank: int | None = None  # optimizer state rank 0 keeps
        self.state_bytes_whole: int | None = None  # the whole optimizer state
        self.size_note: str | None = None  # why `size` ranks were previewed, when not asked
        self.driver_note: str | None = None  # when the driver starting the buckets runs
        self.sharded = False  # ZeRO-1: reduce-scatter and all-gather per dtype (add_sharding)
        self.rank_peak = None  # rank_peak.RankPeak: what one rank holds, phase by phase
        self.shared = False  # summed through the node's shared window (shared_exchange.py)

    @property
    def peak_bytes(self) -> int | None:
        """The most bytes one rank holds in any call of the loop, its first included
        (rank_peak.py), or None."""
        return None if self.rank_peak is None else self.rank_peak.most_bytes

    def add_optimizer(self, name: str, per_rank: int, whole: int) -> None:
        """Report the optimizer state each rank keeps (data_parallel(optimizer=...))."""
        self.optimizer, self.state_bytes_per_rank, self.state_bytes_whole = name, per_rank, whole

    def add_sharding(self, bytes_sent: int) -> None:
        """A ZeRO-1 step: its gradients travel per dtype, not per bucket; bytes_sent: what one
        rank sends per step (sharding.bytes_sent)."""
        self.sharded, self.bytes_sent_per_step = True, bytes_sent

    def summed_in_window(self) -> None:
        """The buckets are summed in the node's shared memory (shared_exchange.py): each rank
        reads every other rank's whole bucket, or its share of a bucket summed in parts and the
        others' summed parts (shared_exchange.bytes_read), in the dtype the window holds."""
        self.shared = True
        for i, (row, bucket) in enumerate(zip(self.buckets, self.layout.buckets, strict=True)):
            sent = bytes_read(bucket, self.size, self.accumulate > 1)
            self.buckets[i] = replace(row, bytes_sent=sent)
        self.bytes_sent_per_step = sum(b.bytes_sent for b in self.buckets)

    def _row(self, bucket: Bucket) -> BucketRow:
        ready = bucket.ready_step
        inside = self.in_plan.get(bucket.index)
        start = ready + 1 if self.split else self.plan_steps
        if inside is not None:
            start = max(inside[0], ready) + 1
        return BucketRow(
            index=bucket.index,
            leaves=tuple(leaf.path for leaf in bucket.leaves),
            dtype=bucket.dtype,
            nbytes=bucket.nbytes,
            ready_step=ready,
            ready_text=bucket.ready_leaf.ready_text,
            start_step=start,
            steps_after_ready=self.plan_steps - 1 - ready,
            bytes_sent=ring_bytes_sent(self._wire_bytes(bucket), self.size),
            calls_in_flight=None if inside is None else inside[1],
        )

    def _wire_bytes(self, bucket: Bucket) -> int:
        """The bytes a bucket takes on the wire: a 16-bit bucket summed in float32, bfloat16
        on two ranks in its own 16 bits (half_sum.py)."""
        if sent_in_16_bits(bucket.dtype, self.size, accumulated=self.accumulate > 1):
            return bucket.nbytes
        return summed_bytes(bucket.nbytes, np_dtype(bucket.dtype))

    def __str__(self) -> str:
        lines = self._summary() + [""] + self._table() + [""] + self._overlap()
        if self.driver_note:
            lines += [""] + textwrap.wrap(
                self.driver_note, 98, initial_indent="  ", subsequent_indent="  "
            )
        lines += self._optimizer_lines()
        if self.rank_peak is not None:
            lines += [""] + self.rank_peak.lines()
        return "\n".join(lines)

    def _optimizer_lines(self) -> list[str]:
        if self.optimizer is None:
            return []
        if self.state_bytes_per_rank == self.state_bytes_whole:
            how = "every rank keeps the whole state and applies the whole update"
        else:
            how = (
                f"sharded (ZeRO-1): each rank keeps the state of its contiguous 1/{self.size} "
                "of each dtype's parameters laid end to end and updates those elements. The "
                "gradients of each dtype are reduce-scattered in one collective instead of "
                "allreduced bucket by bucket (the loss rides in it, one more element per "
                "rank, when it has that dtype), started when the call returns and waited on "
                "before the update; then the updated ranges are all-gathered in one "
                "collective per dtype, started after the update and waited on before step() "
                "returns, into one buffer the new parameters are views of: the bytes of one "
                "allreduce, in two collectives every rank must reach"
            )
        text = (
            f"Optimizer {self.optimizer}: {self.state_bytes_per_rank:,} B of optimizer state "
            f"per rank (rank 0, the largest share) of {self.state_bytes_whole:,} B in all; {how}."
        )
        return [""] + textwrap.wrap(text, 98, initial_indent="  ", subsequent_indent="  ")

    def __repr__(self) -> str:
        return f"<DataParallelReport {self.layout.name}: {len(self.buckets)} bucket(s)>"

    def _summary(self) -> list[str]:
        n_grads = self.layout.n_leaves - 1
        steps = f"{self.plan_steps} steps (s0..s{self.plan_steps - 1})"
        if self.split:
            how = (
                f"The joint plan of {steps} runs as {len(self.cuts()) + 1} segments, cut after "
                "each bucket's last write. Each rank adds up the"
            )
        elif self.in_plan:
            how = (
                f"The joint plan runs forward and backward as one compiled call of {steps}, "
                f"whose driver starts {len(self.in_plan)} of the buckets itself, right after "
                "the kernel that finishes each, writing the gradients straight into the bucket "
                "buffers (no copy). Each rank adds up the"
            )
        else:
            how = (
                f"The joint plan runs forward and backward as one compiled call of {steps}. "
                "Then each rank adds up the"
            )
        text = (
            f"{how} loss and {n_grads} gradient(s), {self.bytes_per_step:,} B, in "
            f"{len(self.buckets)} bucket(s): one non-blocking allreduce (MPI_Iallreduce) each, "
            "started in the order the plan finishes them and waited on in that order before "
            f"the step returns. Each rank sends about {self.bytes_sent_per_step:,} B per step "
            f"(a ring allreduce sends 2 (N-1)/N of the bytes, N={self.size})."
        )
        if self.shared and not self.sharded:
            text = (
                f"{how} loss and {n_grads} gradient(s), {self.bytes_per_step:,} B, in "
                f"{len(self.buckets)} bucket(s) through the node's shared memory (the ranks "
                "are on one node: each maps every rank's segment, a file in /dev/shm made in "
                "the step's first call that exchanges and unmapped when the step is "
                "collected): the compiled plan writes each bucket's gradients straight into "
                "this rank's buffer in it (from its second call, where each gradient has an "
                "output buffer of its own; else they are copied there when the call returns; "
                "16-bit buckets as their 16 bits). A bucket of "
                f"{window_views.IN_PLACE_BYTES:,} B or more is summed in place: once every "
                "rank has written it, each rank sums its 1/N of it (whole pages) from every "
                "rank's buffer, in rank order, averaging as it goes, into its own buffer "
                "(16-bit values widened to float32 as they are added, the sum rounded once "
                "into its 16 bits there), and "
                "the gradients it returns are views of one range that maps every rank's "
                "summed part end to end (no copy; the buffers are used in turn by three calls, "
                "and a rank still holding results when theirs come round again makes the step "
                "take a new window). Other buckets every rank sums whole from every rank's "
                "buffer into its own (16-bit values widened to float32 as they are added, "
                "rounded once when unpacked); on "
                f"{shared_exchange.SPLIT_RANKS} ranks or more a 16-bit bucket of "
                f"{shared_exchange.SPLIT_BYTES:,} B or more in parts (each rank sums 1/N of it "
                "and copies the others' summed parts); no MPI message, in bucket order "
                "before the step returns. Each rank reads about "
                f"{self.bytes_sent_per_step:,} B of the others' buffers per step (N-1 times "
                f"the bytes, 2 (N-1)/N summed in place or in parts, N={self.size}); across "
                "nodes (or "
                "BACKPLAN_DP_REDUCTION=mpi) "
                "one non-blocking allreduce (MPI_Iallreduce) per bucket, started inside the "
                "compiled call, sums them instead."
            )
        if self.sharded:
            text = (
                f"{how} loss and {n_grads} gradient(s), {self.bytes_per_step:,} B (the "
                f"{len(self.buckets)} bucket(s) below), with the optimizer state sharded "
                "(ZeRO-1, below): one non-blocking reduce-scatter per dtype when the call "
                "returns, then the update, then one all-gather per dtype. Each rank sends "
                f"about {self.bytes_sent_per_step:,} B per step (N-1 of the N slots of each, "
                f"N={self.size})."
            )
            if self.shared:
                text += (
                    " The ranks are on one node: both go through the node's shared memory "
                    "(a segment per rank in /dev/shm, every rank's mapped by each, made in the "
                    "step's first call and unmapped when the step is collected): each rank "
                    "writes its send buffer there and sums "
                    "its own slot straight from every rank's, then writes its updated range "
                    "there and reads every rank's (BACKPLAN_DP_REDUCTION=mpi: MPI's "
                    "MPI_Ireduce_scatter_block and MPI_Iallgather)."
                )
        if self.accumulate > 1:
            k = self.accumulate
            text += (
                f" With accumulate={k} the ranks exchange once per {k} calls: the others make "
                "no MPI call (each rank adds up its own loss and gradients) and the last of "
                f"each {k} exchanges the sums as above, about {self.bytes_sent_per_step // k:,} "
                "B per call."
            )
        title = (
            f"data-parallel step: {self.layout.name} on {self.size} ranks, buckets of up to "
            f"{self.bucket_bytes:,} B"
        )
        if self.size_note is not None:
            text = f"{self.size_note} {text}"
        return [title, *textwrap.wrap(text, 98, initial_indent="  ", subsequent_indent="  ")]

    def _table(self) -> list[str]:
        header = (
            "bucket",
            "bytes",
            "read/rank" if self.shared and not self.sharded else "sent/rank",
            "ready after (can start)",
            "starts",
            "waited on",
            "leaves",
        )
        rows = [header] + [
            (
                str(b.index),
                f"{b.nbytes:,}",
                "-" if self.sharded else f"{b.bytes_sent:,}",
                b.ready_text,
                self._start_text(b),
                "before the update" if self.sharded else "before step() returns",
                ", ".join(b.leaves),
            )
            for b in self.buckets
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
        return [
            "  "
            + "  ".join(c.ljust(w) for c, w in zip(row[:-1], widths, strict=False))
            + "  "
            + row[-1]
            for row in rows
        ]

    def cuts(self) -> list[int]:
        """Steps after which a split plan ends a segment."""
        last = self.plan_steps - 1
        return sorted({b.ready_step for b in self.buckets if 0 <= b.ready_step < last})

    def _start_text(self, row: BucketRow) -> str:
        if row.calls_in_flight is not None:
            return f"after s{row.start_step - 1}, inside the call"
        if row.start_step >= self.plan_steps:
            return f"s{self.plan_steps} (call returns)"
        return f"before s{row.start_step} (segment ends)"

    def _overlap(self) -> list[str]:
        hidden = ", ".join(f"bucket {b.index}: {b.steps_after_ready}" for b in self.buckets)
        if self.split:
            text = (
                "Overlap: each bucket's allreduce is in flight while the plan steps after its "
                f"cut run: {hidden}. Without an asynchronous progress thread MPI moves it along "
                "only inside MPI calls, which the step makes between segments."
            )
            return textwrap.wrap(text, 98, initial_indent="  ", subsequent_indent="  ")
        if self.in_plan:
            calls = ", ".join(
                f"bucket {b.index}: {b.calls_in_flight}"
                for b in self.buckets
                if b.calls_in_flight is not None
            )
            text = (
                "Overlap: each bucket started inside the call is in flight while the driver's "
                f"later calls run, and the driver tests it after each (MPI moves a non-blocking "
                f"collective only inside MPI calls); calls run while in flight: {calls}. The "
                "step waits for every bucket after the call returns."
            )
            return textwrap.wrap(text, 98, initial_indent="  ", subsequent_indent="  ")
        if self.shared and not self.sharded:
            text = (
                "Overlap: none; the plan runs as one compiled call, and each rank sums every "
                "bucket (or its part of one summed in place or in parts) when the call returns "
                "(on one core "
                "per rank that is "
                "work of the core that computes, which no overlap could hide)."
            )
            return textwrap.wrap(text, 98, initial_indent="  ", subsequent_indent="  ")
        if self.sharded:
            text = (
                "Overlap: none; the reduce-scatters start when the call returns (their slots "
                "are no buffer the backward writes), the all-gathers after the update."
            )
            return textwrap.wrap(text, 98, initial_indent="  ", subsequent_indent="  ")
        text = (
            "Overlap: the plan runs as one compiled call, so no allreduce starts before it "
            "returns; the schedule sets the buckets and their order, not yet an overlap with "
            "compute. Plan steps that run after each bucket is ready, which splitting the plan "
            f"there (split_plan=True) would run while its allreduce is in flight: {hidden}."
        )
        return textwrap.wrap(text, 98, initial_indent="  ", subsequent_indent="  ")
