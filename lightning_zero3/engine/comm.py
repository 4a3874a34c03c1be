"""The one place that issues collectives.

Every byte zero3 moves between ranks goes through a ``Communicator``. It records, per collective kind,
how many calls, how many bytes, how many seconds from issue to completion, and how many of those
seconds the caller actually sat waiting (*exposed* time; the rest overlapped with compute). Bytes are
counted as nccl-tests counts them: the size of the full (gathered, or pre-scatter) buffer.

All-gathers and reduce-scatters may be issued asynchronously: the call returns a ``Pending`` whose
``wait()`` completes it. With a world of one rank the collectives are plain copies: the engine runs the
same code path.

[Note: measured collective choice]
Backends differ per operation and message size (gloo's reduce-scatter, for one, can lose to an
all-reduce of the same buffer). ``tune`` times each way of doing an all-gather and a reduce-scatter at
the message sizes the engine will use, takes every rank's worst time (so all ranks pick the same way),
and keeps the fastest per (kind, size).

[Note: completion time]
An async collective's time runs from issue to *completion*. Where the backend's work object offers a
future (gloo's all-gathers and all-reduces do), a done-callback stamps the moment it completed on the
backend's own thread, so a collective that finished long before the caller waited is not charged the
compute in between. Otherwise (gloo's reduce-scatter, NCCL, whose futures complete on stream
synchronisation) the time runs to the end of ``wait()``, an upper bound.

[Note: three process groups]
All-gathers run on the job's group, in the order of the recorded execution trace, the same on every
rank. Reduce-scatters run on a group of their own (same ranks, same backend, same timeout): a rank
issues a unit's reduce-scatter once the unit's backward is over there (see ``grads.ReductionQueue``),
a moment that legitimately differs between ranks relative to their all-gathers; on one group, gloo and
NCCL would pair one rank's reduce-scatter with another rank's all-gather. A third group carries the
tiny blocking identity checks that precede every all-gather (``agree``, see [Note: every all-gather is
checked] in agreement.py): on the job's group a check would queue behind the large gathers in flight
and wait for them (NCCL runs one group's collectives in order on one stream), undoing the prefetch; it
is a gloo group whatever the job's backend (host tags, no device synchronisation).

[Note: peak bandwidth]
``measure_peaks`` times each (kind, size) this job has used, synchronously on the quiet group, and
keeps the slowest rank's median: the busbw a collective of that size reaches here at best. Monitors
divide the bandwidth reached in training by it (utilization); it is measured, never assumed.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist


@dataclass
class CollectiveStats:
    """Totals for one collective kind since the engine started."""

    count: int = 0
    bytes: int = 0
    seconds: float = 0.0  # issue to completion
    exposed_seconds: float = 0.0  # time the caller spent blocked waiting

    def add(self, nbytes: int, seconds: float, exposed: float) -> None:
        self.count += 1
        self.bytes += nbytes
        self.seconds += seconds
        self.exposed_seconds += exposed


class Pending:
    """An issued collective. ``wait()`` blocks until it completes (once), then runs its finisher."""

    def __init__(
        self, work: Any, stats: list[CollectiveStats], nbytes: int, finish: Optional[Callable[[], None]]
    ) -> None:
        self._work = work
        self._stats = stats
        self._nbytes = nbytes
        self._finish = finish
        self._issued = time.perf_counter()
        self._completed: Optional[float] = None  # stamped by the backend's thread, see [Note: completion time]
        self.done = False
        if work is not None and finish is None:
            try:
                work.get_future().add_done_callback(self._stamp)
            except RuntimeError:  # this backend / op has no future
                pass

    def _stamp(self, _future: Any) -> None:
        self._completed = time.perf_counter()

    def ready(self) -> bool:
        """Whether ``wait()`` would return without blocking (the collective has completed)."""
        return self.done or self._work is None or self._work.is_completed()

    def wait(self) -> None:
        if self.done:
            return
        start = time.perf_counter()
        if self._work is not None:
            self._work.wait()
        if self._finish is not None:
            self._finish()
        end = time.perf_counter()
        completed = min(self._completed, end) if self._completed is not None else end
        # exposed: from the wait to the completion; the caller's wake-up after it is the scheduler's, not
        # the collective's (on a loaded machine it made exposed exceed issue-to-completion)
        for stats in self._stats:
            stats.add(self._nbytes, completed - self._issued, max(0.0, completed - start))
        self.done = True


# The ways of doing each collective that ``tune`` chooses between.
ALL_GATHER_WAYS = ("all_gather_single", "all_gather_list")
REDUCE_SCATTER_WAYS = ("reduce_scatter_single", "all_reduce_slice")


class Communicator:
    """Collectives over one process group (the data-parallel group), with byte and time accounting."""

    KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")
    #: nccl-tests' busbw / algbw factor per kind, for a group of n ranks (``PERFORMANCE.md``)
    BUS_FACTOR = {
        "all_gather": lambda n: (n - 1) / n,
        "reduce_scatter": lambda n: (n - 1) / n,
        "all_reduce": lambda n: 2 * (n - 1) / n,
        "broadcast": lambda n: 1.0,
    }

    def __init__(self, group: Optional[dist.ProcessGroup] = None) -> None:
        self.group = group
        # see [Note: three process groups]; both are the job's group until ``open_side_groups``
        self.reduce_group: Optional[dist.ProcessGroup] = group
        self.check_group: Optional[dist.ProcessGroup] = group
        self._side_groups: list[dist.ProcessGroup] = []
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
        else:
            self.rank, self.world_size = 0, 1
        self.stats = {kind: CollectiveStats() for kind in self.KINDS}
        self.by_size: dict[tuple[str, int], CollectiveStats] = {}  # (kind, bytes) -> totals at that size
        self._dtypes: dict[tuple[str, int], torch.dtype] = {}  # the dtype each (kind, bytes) was seen in
        self.choice: dict[tuple[str, int], str] = {}  # (kind, bytes of the full buffer) -> way, by ``tune``
        self.peak_busbw: dict[tuple[str, int], float] = {}  # bytes/s, by ``measure_peaks``
        self.checks = 0  # identity checks run by ``agree``

    def _sinks(self, kind: str, tensor: torch.Tensor) -> list[CollectiveStats]:
        """Where one collective of ``kind`` over ``tensor`` (the full buffer) is counted."""
        key = (kind, tensor.numel() * tensor.element_size())
        if key not in self.by_size:
            self.by_size[key] = CollectiveStats()
            self._dtypes[key] = tensor.dtype
        return [self.stats[kind], self.by_size[key]]

    def open_side_groups(self, timeout: Optional[timedelta] = None) -> None:
        """Create the reduce-scatter and check groups (once; a collective over every rank of the job, as
        ``torch.distributed.new_group`` is)."""
        if not self.distributed or self._side_groups:
            return
        ranks = dist.get_process_group_ranks(self.group) if self.group is not None else None
        backend = dist.get_backend(self.group)
        # not ``use_local_synchronization``: its groups are named after their ranks, and two groups of the
        # same ranks would then meet under one name in the store. The checks run on gloo whatever the
        # job's backend: 80-byte tags read on the host, no device stream to synchronise, no NCCL buffers.
        reduce = dist.new_group(ranks, timeout=timeout, backend=backend, group_desc="zero3_reduce")
        check = dist.new_group(ranks, timeout=timeout, backend="gloo", group_desc="zero3_check")
        self.reduce_group, self.check_group = reduce, check
        self._side_groups = [reduce, check]

    def close_side_groups(self) -> None:
        """Destroy the groups ``open_side_groups`` made (local; the collectives on them must be done)."""
        for group in self._side_groups:
            dist.destroy_process_group(group)
        self._side_groups = []
        self.reduce_group = self.check_group = self.group

    def bus_factor(self, kind: str) -> float:
        return self.BUS_FACTOR[kind](self.world_size) if self.world_size > 1 else 1.0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    # -- sharding collectives (sync or async) -----------------------------------------------------

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, async_op: bool = False) -> Optional[Pending]:
        """Fill ``output`` (``world_size * shard.numel()`` elements) with every rank's ``shard`` in rank order."""
        nbytes = output.numel() * output.element_size()
        if not self.distributed:
            output.copy_(shard)
            return self._finish(Pending(None, self._sinks("all_gather", output), nbytes, None), async_op)
        way = self.choice.get(("all_gather", nbytes), ALL_GATHER_WAYS[0])
        if way == "all_gather_list":
            work = dist.all_gather(list(output.chunk(self.world_size)), shard, group=self.group, async_op=True)
        else:
            work = dist.all_gather_single(output, shard, group=self.group, async_op=True)
        return self._finish(Pending(work, self._sinks("all_gather", output), nbytes, None), async_op)

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor, async_op: bool = False) -> Optional[Pending]:
        """Sum ``full`` over ranks and leave this rank's slice of the sum in ``output``."""
        nbytes = full.numel() * full.element_size()
        if not self.distributed:
            output.copy_(full)
            return self._finish(Pending(None, self._sinks("reduce_scatter", full), nbytes, None), async_op)
        way = self.choice.get(("reduce_scatter", nbytes), REDUCE_SCATTER_WAYS[0])
        finish = None
        group = self.reduce_group  # [Note: three process groups]
        if way == "all_reduce_slice":
            work = dist.all_reduce(full, op=dist.ReduceOp.SUM, group=group, async_op=True)
            start = self.rank * output.numel()
            finish = lambda: output.copy_(full[start : start + output.numel()])  # noqa: E731
        else:
            work = dist.reduce_scatter_single(output, full, op=dist.ReduceOp.SUM, group=group, async_op=True)
        return self._finish(Pending(work, self._sinks("reduce_scatter", full), nbytes, finish), async_op)

    @staticmethod
    def _finish(pending: Pending, async_op: bool) -> Optional[Pending]:
        if async_op:
            return pending
        pending.wait()
        return None

    # -- small synchronous collectives ------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        start = time.perf_counter()
        if self.distributed:
            dist.all_reduce(tensor, op=op, group=self.group)
        elapsed = time.perf_counter() - start
        for stats in self._sinks("all_reduce", tensor):
            stats.add(tensor.numel() * tensor.element_size(), elapsed, elapsed)
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        start = time.perf_counter()
        if self.distributed:
            dist.broadcast(tensor, src=dist.get_global_rank(self.group, src) if self.group else src, group=self.group)
        elapsed = time.perf_counter() - start
        for stats in self._sinks("broadcast", tensor):
            stats.add(tensor.numel() * tensor.element_size(), elapsed, elapsed)
        return tensor

    def all_gather_objects(self, obj: Any, on_check_group: bool = False) -> list:
        """Every rank's ``obj``, in rank order. For small Python objects (layouts, scalars), never weights.
        ``on_check_group``: on the check group (see [Note: three process groups])."""
        if not self.distributed:
            return [obj]
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, obj, group=self.check_group if on_check_group else self.group)
        return everyone

    def agree(self, tag: list[int], before: Optional[str] = None) -> list[list[int]]:
        """Every rank's ``tag`` (a short list of integers, the same length on every rank), in rank order:
        a blocking all-gather on the check group. ``before="all_gather"``: the check precedes that kind of
        collective; the time spent here, waiting for the other ranks to reach it, is that collective's
        time, and all of it exposed (as it was when the wait happened inside the collective itself);
        the bytes and counts per message size stay the collective's own."""
        if not self.distributed:
            return [list(tag)]
        start = time.perf_counter()
        host = torch.device("cpu") if self._side_groups else self.device  # the check group is gloo's
        mine = torch.tensor(tag, dtype=torch.int64, device=host)
        everyone = torch.empty(self.world_size * len(tag), dtype=torch.int64, device=host)
        dist.all_gather_single(everyone, mine, group=self.check_group)
        rows = everyone.view(self.world_size, len(tag)).tolist()
        self.checks += 1
        if before is not None:
            elapsed = time.perf_counter() - start
            self.stats[before].seconds += elapsed
            self.stats[before].exposed_seconds += elapsed
        return rows

    @property
    def device(self) -> torch.device:
        if self.distributed and dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # -- [Note: measured collective choice] -------------------------------------------------------

    def tune(self, sizes: Iterable[tuple[int, torch.dtype]], device: torch.device, repeats: int = 3) -> None:
        """Time every way of each sharding collective at each (full numel, dtype); keep the fastest."""
        if not self.distributed:
            return
        # a fixed order on every rank (a set of dtypes iterates differently in each process)
        for numel, dtype in sorted(set(sizes), key=lambda s: (s[0], str(s[1]))):
            full = torch.zeros(numel, dtype=dtype, device=device)
            nbytes = full.numel() * full.element_size()
            shard = torch.zeros(numel // self.world_size, dtype=dtype, device=device)
            for kind, ways in (("all_gather", ALL_GATHER_WAYS), ("reduce_scatter", REDUCE_SCATTER_WAYS)):
                times = []
                for way in ways:
                    self.choice[(kind, nbytes)] = way
                    times.append(self._time(kind, full, shard, repeats))
                worst = torch.tensor(times, dtype=torch.float64, device=self.device)
                dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=self.group)  # every rank decides alike
                self.choice[(kind, nbytes)] = ways[int(torch.argmin(worst))]
        self.reset_stats()  # tuning traffic is not training traffic

    def reset_stats(self) -> None:
        self.stats = {kind: CollectiveStats() for kind in self.KINDS}
        self.by_size = {}
        self._dtypes = {}

    # -- [Note: peak bandwidth] ----------------------------------------------------------------------

    def measure_peaks(self, repeats: int = 3) -> dict[tuple[str, int], float]:
        """Peak busbw (bytes/s) of every (kind, size) used so far, measured now on this group (a collective:
        every rank must call it at the same point, after running the same collectives)."""
        saved = self.stats, self.by_size, self._dtypes
        self.reset_stats()
        for kind, nbytes in sorted(saved[1]):  # the same order on every rank
            if (kind, nbytes) in self.peak_busbw:
                continue
            dtype = saved[2][(kind, nbytes)]
            full = torch.zeros(nbytes // dtype.itemsize, dtype=dtype, device=self.device)
            shard = full[: full.numel() // self.world_size].clone()
            best = self._time(kind, full, shard, repeats, recorded=True, pick=min)
            seconds = torch.tensor([best], dtype=torch.float64, device=self.device)
            if self.distributed:
                dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=self.group)
            self.peak_busbw[(kind, nbytes)] = nbytes / max(float(seconds), 1e-9) * self.bus_factor(kind)
        self.stats, self.by_size, self._dtypes = saved  # measuring traffic is not training traffic
        return dict(self.peak_busbw)

    def _time(
        self, kind: str, full: torch.Tensor, shard: torch.Tensor, repeats: int, recorded: bool = False, pick=statistics.median
    ) -> float:
        """Seconds per call (``pick`` of ``repeats`` after a warm-up). ``recorded``: as the accounting times
        a collective in training (see [Note: completion time]), not around the call."""
        samples, key = [], (kind, full.numel() * full.element_size())
        for _ in range(repeats + 1):  # the first call warms up
            before = self.by_size[key].seconds if key in self.by_size else 0.0
            start = time.perf_counter()
            if kind == "all_gather":
                self.all_gather(full, shard)
            elif kind == "reduce_scatter":
                self.reduce_scatter(shard, full)
            elif kind == "all_reduce":
                self.all_reduce(full)
            else:
                self.broadcast(full)
            if full.is_cuda:
                torch.cuda.synchronize(full.device)
            elapsed = time.perf_counter() - start
            samples.append(self.by_size[key].seconds - before if recorded else elapsed)
        return pick(samples[1:])
