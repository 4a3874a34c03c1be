"""The one place that issues collectives.

Every byte zero3 moves between ranks goes through a ``Communicator``. It records, per collective kind,
how many calls, how many bytes, how many seconds from issue to completion, and how many of those
seconds the compute side actually waited (*exposed* time; the rest overlapped with compute), on every
backend: see [Note: completion time] in ``timing.py``. Bytes are counted as nccl-tests counts them:
the size of the full (gathered, or pre-scatter) buffer. The same totals are kept per process group
(``by_group``), with the bytes that came from other nodes (see [Note: inter-node bytes] in topology.py).

All-gathers and reduce-scatters may be issued asynchronously: the call returns a ``Pending`` whose
``wait()`` completes it. With a world of one rank the collectives are plain copies: the engine runs the
same code path.

[Note: measured collective choice]
Backends differ per operation and message size (gloo's reduce-scatter, for one, can lose to an
all-reduce of the same buffer). ``tune`` times each way of doing an all-gather and a reduce-scatter at
the message sizes the engine will use: a warm-up call of each way, then ``repeats`` rounds that call
every way once in turn (a slow spell of a shared machine then hits them all alike; timing one way's
calls and then the next's let it decide: for a block of the benchmark GPT on 2 CPU ranks, 3 calls of
each way one after the other picked gloo's all-gather over the swap of shards, at twice its CPU time, at
1 start-up in 10, and 3 rounds in turn picked the swap at 10 in 10),
each call timed on the host from the call to the end of the device's work (the whole cost a way adds,
its finisher's copy included). Per rank it takes the median (one stray slow call on a shared machine does not decide), then
the slowest rank's median (a collective is over when it is over everywhere, and a MAX all-reduce gives every rank the same
figures, so all ranks pick the same way), and keeps the fastest way per (kind, size).

[Note: long calls are timed once]
Tuning costs a warm-up call and ``repeats`` calls of every way, of both kinds, at every size: 16 calls of
a unit's full size where two ways of each kind are offered. For a large unit on a slow link that is a
start-up cost of its own (a decoder layer of a 1B Llama, 176 MB in fp32, on 4 CPU ranks over gloo: engine
setup less its read took 7.2 s with three rounds, 3.5 s with one; RESULTS.md, time to the first step). The medians guard against a stray slow call, which matters where a call is short; a
call of ``LONG_CALL`` (0.1 s) or more is long against such a stray, and the warm-up calls say which
sizes those are. So where the quickest way's warm-up call took ``LONG_CALL`` or more on the slowest rank
(one MAX all-reduce: every rank sees the same figure and runs the same number of calls), the ways are
timed in one round, not ``repeats``.

[Note: three process groups]
All-gathers run on the job's group, in the order of the recorded execution trace, the same on every
rank. Reduce-scatters run on a group of their own (same ranks, same backend, same timeout): a rank
issues a unit's reduce-scatter once the unit's backward is over there (see ``grads.ReductionQueue``),
a moment that legitimately differs between ranks relative to their all-gathers; on one group, gloo and
NCCL would pair one rank's reduce-scatter with another rank's all-gather. A third group carries the
tiny blocking identity checks that precede every all-gather (``agree``, see [Note: every all-gather is
checked] in agreement.py): on the job's group a check would queue behind the large gathers in flight
and wait for them (NCCL runs one group's collectives in order on one stream), undoing the prefetch; it
is a gloo group whatever the job's backend (host tags, no device synchronisation). With secondary shards
(``secondary_shard_size``) a fourth kind of group joins them: see [Note: node-local secondary groups].

[Note: peak bandwidth]
``measure_peaks`` times each (kind, size) this job has used as nccl-tests does: on the job's own group,
at the job's own message sizes, synchronously (each call alone on the group), after ``warmup`` untimed
calls, over ``repeats`` timed ones. Each call is timed by the same clock that times training's
collectives, so utilization compares like with like. Per rank it keeps the median of the timed calls:
a minimum is the luckiest of a few samples, which training is not expected to reach, and a mean is
pulled by one stray slow call on a shared machine. Across ranks it keeps the slowest rank's median
(MAX all-reduce): every rank holds the same peak, and a collective is over when its slowest rank is
done. (nccl-tests averages a loop of back-to-back calls; a per-call median needs no loop here, because
every call's own start and end are recorded.) Monitors divide the busbw training reaches by this peak
(utilization); it is measured, never assumed, and never raised to what training reaches: training beating
it means the measurement was off, and a monitor says so.
"""

from __future__ import annotations

import statistics
import time
import weakref
from collections import deque
from datetime import timedelta
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist

from .collective_log import LOG, collective
from .records import Agreement, CollectiveStats, Pending, Works
from .timing import Clock, Span, clock_for
from .topology import Topology, inter_node_bytes

# The ways of doing each collective that ``tune`` chooses between.
ALL_GATHER_WAYS = ("all_gather_single", "all_gather_list")
REDUCE_SCATTER_WAYS = ("reduce_scatter_single", "all_reduce_slice")
# a third way of each for groups of two ranks: [Note: a pair swaps halves], [Note: a pair swaps shards]
PAIR_EXCHANGE = "exchange_pair"
# a size whose quickest way takes this long is timed in one round: [Note: long calls are timed once]
LONG_CALL = 0.1


# every Communicator of this process, for ``forget_process_groups`` (see [Note: process groups closed at exit])
_COMMUNICATORS: "weakref.WeakSet[Communicator]" = weakref.WeakSet()


def forget_process_groups() -> None:
    """Every Communicator of this process drops its handles on process groups (destroyed already, or about
    to be), so that a group nothing else holds is freed, and its gloo threads joined, now."""
    for comm in list(_COMMUNICATORS):
        comm.forget_groups()


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

    def __init__(self, group: Optional[dist.ProcessGroup] = None, ranks_per_node: Optional[int] = None) -> None:
        """``ranks_per_node``: how many consecutive global ranks share a node (the Trainer's ``devices``);
        None: ``LOCAL_WORLD_SIZE`` if set, else one node (see ``topology.py``)."""
        self.group = group
        # see [Note: three process groups]; both are the job's group until ``open_side_groups``
        self.reduce_group: Optional[dist.ProcessGroup] = group
        self.check_group: Optional[dist.ProcessGroup] = group
        self._side_groups: list[dist.ProcessGroup] = []
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
            self.global_rank = dist.get_rank()
            members = dist.get_process_group_ranks(group) if group is not None else list(range(self.world_size))
            job_size = dist.get_world_size()
        else:
            self.rank, self.world_size, self.global_rank, members, job_size = 0, 1, 0, [0], 1
        self.topology = Topology.from_environment(job_size, ranks_per_node)
        self.members = members  # global ranks of the job's group, in group-rank order
        # [Note: node-local secondary groups]: this rank's group of consecutive ranks, by ``open_secondary_groups``
        self.secondary_group: Optional[dist.ProcessGroup] = None
        self.secondary_members: list[int] = [self.global_rank]
        self._secondary_groups: list[dist.ProcessGroup] = []
        self._stats = {kind: CollectiveStats() for kind in self.KINDS}
        self._by_size: dict[tuple[str, int], CollectiveStats] = {}  # (kind, bytes) -> totals at that size
        self._by_group: dict[tuple[str, str], CollectiveStats] = {}  # (group name, kind) -> totals
        self._dtypes: dict[tuple[str, int], torch.dtype] = {}  # the dtype each (kind, bytes) was seen in
        self._clock: Optional[Clock] = None  # chosen by the group's device on first use
        self._timings: deque[tuple[Span, list[CollectiveStats], int, int]] = deque()  # waited, not yet added
        self.choice: dict[tuple[str, int], str] = {}  # (kind, bytes of the full buffer) -> way, by ``tune``
        # the tag of the last point-to-point swap per kind, counted alike on both ranks ([Note: swap tags])
        self._pair_tags = {"all_gather": 0, "reduce_scatter": 0}
        self.peak_busbw: dict[tuple[str, int], float] = {}  # bytes/s, by ``measure_peaks``
        _COMMUNICATORS.add(self)
        self.checks = 0  # identity checks run by ``agree``

    def _sinks(self, kind: str, tensor: torch.Tensor, over: str = "job") -> list[CollectiveStats]:
        """Where one collective of ``kind`` over ``tensor`` (the full buffer) on group ``over`` is counted:
        the kind's totals, the group's, and (on the job's ranks) the totals at that message size, which
        ``measure_peaks`` times again on the job's group."""
        sinks = [self._stats[kind], self._by_group.setdefault((over, kind), CollectiveStats())]
        if over in ("job", "reduce"):
            key = (kind, tensor.numel() * tensor.element_size())
            if key not in self._by_size:
                self._by_size[key] = CollectiveStats()
                self._dtypes[key] = tensor.dtype
            sinks.append(self._by_size[key])
        return sinks

    # -- [Note: inter-node bytes] in topology.py ---------------------------------------------------

    def group_members(self, over: str) -> list[int]:
        """Global ranks of the group a collective runs ``over``: "job", "reduce", "check" or "secondary"."""
        return self.secondary_members if over == "secondary" else self.members

    def group_size(self, over: str) -> int:
        """Ranks in the group a collective runs ``over``."""
        return len(self.secondary_members) if over == "secondary" else self.world_size

    def _inter_node(self, kind: str, nbytes: int, over: str) -> int:
        members = self.group_members(over)
        return inter_node_bytes(kind, nbytes, len(members), self.topology.remote_members(members, self.global_rank))

    @property
    def by_group(self) -> dict[tuple[str, str], CollectiveStats]:
        """Totals per (group, kind), every waited collective included. Groups: "job" (all-gathers from the
        primary shards, all-reduces, broadcasts), "reduce" (reduce-scatters), "check" (identity checks, kind
        "check") and "secondary" (all-gathers from node-local secondary shards)."""
        self.settle()
        return self._by_group

    def inter_node_total(self, kind: Optional[str] = None, over: Optional[str] = None) -> int:
        """Bytes this rank received from other nodes so far, over every kind and group or those named."""
        return sum(
            s.inter_node_bytes for (group, k), s in self.by_group.items()
            if (kind is None or k == kind) and (over is None or group == over)
        )  # fmt: skip

    # -- time accounting ([Note: completion time] in timing.py) ----------------------------------

    #: waited collectives held before the hot path drains those whose time can already be read
    DRAIN_AT = 64

    @property
    def stats(self) -> dict[str, CollectiveStats]:
        """Totals per collective kind, every waited collective's time included (on CUDA: one sync)."""
        self.settle()
        return self._stats

    @property
    def by_size(self) -> dict[tuple[str, int], CollectiveStats]:
        """Totals per (kind, bytes of the full buffer), every waited collective's time included."""
        self.settle()
        return self._by_size

    @property
    def clock(self) -> Clock:
        if self._clock is None:
            self._clock = clock_for(self.device)
        return self._clock

    @property
    def pending_timings(self) -> int:
        """Waited collectives whose time is not in the totals yet."""
        return len(self._timings)

    def _record(self, span: Span, sinks: list[CollectiveStats], nbytes: int, inter_node: int = 0) -> None:
        self._timings.append((span, sinks, nbytes, inter_node))
        if len(self._timings) > self.DRAIN_AT:
            self.settle(block=False)

    def settle(self, block: bool = True) -> None:
        """Add waited collectives' times to the totals, in issue order; ``block=False``: only those whose
        time can be read now (no device sync), stopping at the first that cannot."""
        while self._timings:
            span, sinks, nbytes, inter_node = self._timings[0]
            if not span.ready():
                if not block:
                    return
                span.settle()
            self._timings.popleft()
            seconds, exposed = span.seconds(), span.exposed()
            for stats in sinks:
                stats.add(nbytes, seconds, exposed, inter_node)

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

    def open_secondary_groups(self, size: int, timeout: Optional[timedelta] = None) -> None:
        """Create the groups of ``size`` consecutive ranks of the job's group that secondary shards are
        gathered over, and keep this rank's (once; a collective over every rank of the job).

        [Note: node-local secondary groups]
        ``torch.distributed.new_group`` is a collective over the whole job even for a subgroup, so every
        rank creates every group, in the same order (0..size-1, size..2 size-1, ...), and keeps its own.
        They carry all-gathers only, issued in the recorded execution order like those on the job's group;
        a group of one rank needs no process group (its all-gather is a copy). With ``size`` the ranks of
        a node, the group never crosses a node boundary."""
        if self._secondary_groups or size <= 1 or size >= self.world_size:
            return  # open already; or one rank each (no group needed), or the job's group itself
        backend = dist.get_backend(self.group)
        for start in range(0, self.world_size, size):
            members = self.members[start : start + size]
            group = dist.new_group(members, timeout=timeout, backend=backend, group_desc=f"zero3_secondary_{start}")
            self._secondary_groups.append(group)
            if self.global_rank in members:
                self.secondary_group, self.secondary_members = group, members

    def close_secondary_groups(self) -> None:
        """Destroy the groups ``open_secondary_groups`` made (local; the collectives on them must be done)."""
        for group in self._secondary_groups:
            dist.destroy_process_group(group)
        self._secondary_groups = []
        self.secondary_group, self.secondary_members = None, [self.global_rank]

    def close_side_groups(self) -> None:
        """Destroy the groups ``open_side_groups`` and ``open_secondary_groups`` made (local; the collectives
        on them must be done)."""
        for group in self._side_groups:
            dist.destroy_process_group(group)
        self._side_groups = []
        self.reduce_group = self.check_group = self.group
        self.close_secondary_groups()

    def forget_groups(self) -> None:
        """Drop the handles on every process group (the job's included), as the process ends: after
        ``torch.distributed.destroy_process_group`` no collective can run on them anyway."""
        self.group = self.reduce_group = self.check_group = self.secondary_group = None
        self._side_groups, self._secondary_groups = [], []

    def bus_factor(self, kind: str) -> float:
        return self.BUS_FACTOR[kind](self.world_size) if self.world_size > 1 else 1.0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    # -- sharding collectives (sync or async) -----------------------------------------------------

    def all_gather(
        self, output: torch.Tensor, shard: torch.Tensor, async_op: bool = False, over: str = "job"
    ) -> Optional[Pending]:
        """Fill ``output`` (``n * shard.numel()`` elements) with the ``shard`` of every rank of the group in
        rank order: ``over="job"`` the job's group (n = world size), ``"secondary"`` this rank's
        node-local secondary group (see [Note: node-local secondary groups])."""
        nbytes = output.numel() * output.element_size()
        span = self.clock.span()
        sinks, inter_node = self._sinks("all_gather", output, over), self._inter_node("all_gather", nbytes, over)
        n = self.group_size(over)
        if n == 1:
            if output.data_ptr() != shard.data_ptr():  # one rank whose shard is the output already
                output.copy_(shard)
            return self._finish(Pending(self, None, span, sinks, nbytes, None, inter_node), async_op)
        group = self.secondary_group if over == "secondary" else self.group
        entry = LOG.issue(over, "all-gather", output.numel(), self.secondary_members if over == "secondary" else None)
        way = self.choice.get(("all_gather", nbytes), ALL_GATHER_WAYS[0]) if over == "job" else ALL_GATHER_WAYS[0]
        if way == PAIR_EXCHANGE:
            work = self._swap_shards(output, shard, group)
        elif way == "all_gather_list":
            work = dist.all_gather(list(output.chunk(n)), shard, group=group, async_op=True)
        else:
            work = dist.all_gather_single(output, shard, group=group, async_op=True)
        return self._finish(Pending(self, work, span, sinks, nbytes, None, inter_node, entry), async_op)

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor, async_op: bool = False) -> Optional[Pending]:
        """Sum ``full`` over ranks and leave this rank's slice of the sum in ``output``."""
        nbytes = full.numel() * full.element_size()
        span = self.clock.span()
        sinks = self._sinks("reduce_scatter", full, "reduce")
        if not self.distributed:
            output.copy_(full)
            return self._finish(Pending(self, None, span, sinks, nbytes, None), async_op)
        way = self.choice.get(("reduce_scatter", nbytes), REDUCE_SCATTER_WAYS[0])
        finish = None
        group = self.reduce_group  # [Note: three process groups]
        entry = LOG.issue("reduce", "reduce-scatter", full.numel())
        if way == PAIR_EXCHANGE:
            work, finish = self._swap_halves(output, full, group)
            inter_node = self._inter_node("reduce_scatter", nbytes, "reduce")
        elif way == "all_reduce_slice":
            work = dist.all_reduce(full, op=dist.ReduceOp.SUM, group=group, async_op=True)
            start = self.rank * output.numel()
            finish = lambda: output.copy_(full[start : start + output.numel()])  # noqa: E731
            inter_node = self._inter_node("all_reduce", nbytes, "reduce")  # it moves what an all-reduce moves
        else:
            work = dist.reduce_scatter_single(output, full, op=dist.ReduceOp.SUM, group=group, async_op=True)
            inter_node = self._inter_node("reduce_scatter", nbytes, "reduce")
        return self._finish(Pending(self, work, span, sinks, nbytes, finish, inter_node, entry), async_op)

    def _swap(self, kind: str, send: torch.Tensor, receive: torch.Tensor, group: Any) -> Works:
        """Send ``send`` to the other rank of a two-rank ``group`` and receive its message into ``receive``.

        [Note: swap tags]
        Each message carries a tag that both ranks count alike per kind: all-gathers are issued in one
        order on every rank (the recorded execution order, each agreed on first, see agreement.py), and so
        are reduce-scatters ([Note: reduction order] in engine/grads/reduction.py), so several swaps in flight cannot be
        confused. The two kinds keep counters of their own: how a rank's gathers and reductions interleave
        legitimately differs between ranks (see [Note: three process groups])."""
        peer = dist.get_global_rank(group, 1 - self.rank) if group is not None else 1 - self.rank
        tag = self._pair_tags[kind] = (self._pair_tags[kind] + 1) % (1 << 30)
        return Works(dist.batch_isend_irecv([
            dist.P2POp(dist.isend, send, peer, group, tag),
            dist.P2POp(dist.irecv, receive, peer, group, tag),
        ]))  # fmt: skip

    def _swap_halves(self, output: torch.Tensor, full: torch.Tensor, group: Any) -> tuple[Works, Callable[[], None]]:
        """The reduce-scatter of a group of two ranks as one swap: each sends the half of ``full`` that the
        other keeps and receives the other's copy of its own half straight into ``output``; the finisher
        adds its own half.

        [Note: a pair swaps halves]
        On two CPU ranks gloo's reduce-scatter (and an all-reduce keeping the slice, which moves twice the
        bytes) costs several times the CPU of one swap of the halves plus one add; ``tune`` times the ways
        and takes the fastest. It moves what a reduce-scatter must: half of the buffer each way. The sum is the other rank's half
        plus this rank's, which is the same number as a reduce-scatter's rank-0-plus-rank-1 (floating-point
        addition of two terms does not depend on their order), so results are bitwise those of the other
        ways."""
        me, width = self.rank, output.numel()
        works = self._swap("reduce_scatter", full[(1 - me) * width : (2 - me) * width], output, group)
        mine = full[me * width : (me + 1) * width]
        return works, lambda: output.add_(mine)

    def _swap_shards(self, output: torch.Tensor, shard: torch.Tensor, group: Any) -> Works:
        """The all-gather of a group of two ranks as one swap: each sends its ``shard`` and receives the
        other's straight into its place in ``output``, and copies its own into place meanwhile.

        [Note: a pair swaps shards]
        A gather moves the same bytes either way (one shard each way); the swap skips gloo's collective
        machinery (its worker thread and its staging of the output), so on two CPU ranks it costs less CPU
        per call than gloo's all-gather (``tune`` times both and takes the faster)."""
        me, width = self.rank, shard.numel()
        works = self._swap("all_gather", shard, output[(1 - me) * width : (2 - me) * width], group)
        mine = output[me * width : (me + 1) * width]
        if mine.data_ptr() != shard.data_ptr():
            mine.copy_(shard)
        return works

    def _pair_ways(self) -> tuple[str, ...]:
        """What two ranks may also do ([Note: a pair swaps halves], [Note: a pair swaps shards])."""
        return (PAIR_EXCHANGE,) if self.world_size == 2 else ()

    @staticmethod
    def _finish(pending: Pending, async_op: bool) -> Optional[Pending]:
        if async_op:
            return pending
        pending.wait()
        return None

    # -- small synchronous collectives ------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        span, work, nbytes, entry = self.clock.span(), None, tensor.numel() * tensor.element_size(), None
        if self.distributed:
            entry = LOG.issue("job", "all-reduce", tensor.numel())
            work = dist.all_reduce(tensor, op=op, group=self.group, async_op=True)
        inter_node = self._inter_node("all_reduce", nbytes, "job")
        Pending(self, work, span, self._sinks("all_reduce", tensor), nbytes, None, inter_node, entry).wait()
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        span, work, nbytes = self.clock.span(), None, tensor.numel() * tensor.element_size()
        inter_node, entry = 0, None
        if self.distributed:
            root = dist.get_global_rank(self.group, src) if self.group else src
            entry = LOG.issue("job", "broadcast", tensor.numel())
            work = dist.broadcast(tensor, src=root, group=self.group, async_op=True)
            inter_node = nbytes if self.topology.node_of(root) != self.topology.node_of(self.global_rank) else 0
        Pending(self, work, span, self._sinks("broadcast", tensor), nbytes, None, inter_node, entry).wait()
        return tensor

    def all_gather_objects(self, obj: Any, on_check_group: bool = False) -> list:
        """Every rank's ``obj``, in rank order. For small Python objects (layouts, scalars), never weights.
        ``on_check_group``: on the check group (see [Note: three process groups])."""
        if not self.distributed:
            return [obj]
        everyone: list = [None] * self.world_size
        with collective("check" if on_check_group else "job", "all-gather of Python objects"):
            dist.all_gather_object(everyone, obj, group=self.check_group if on_check_group else self.group)
        return everyone

    def agree(self, tag: list[int], before: Optional[str] = None) -> list[list[int]]:
        """Every rank's ``tag`` (a short list of integers, the same length on every rank), in rank order:
        a blocking all-gather on the check group. ``before="all_gather"``: the check precedes that kind of
        collective; the time spent here, waiting for the other ranks to reach it, is that collective's
        time, and all of it exposed (as it was when the wait happened inside the collective itself);
        the bytes and counts per message size stay the collective's own."""
        return self.agree_later(tag, before).rows()

    def agree_later(self, tag: list[int], before: Optional[str] = None, what: Any = None) -> "Agreement":
        """``agree`` without waiting: the tag goes out now, ``rows()`` waits for every rank's (only the
        wait counts as the collective's exposed time). ``what``: the units checked, for the watchdog."""
        if not self.distributed:
            return Agreement(self, None, [list(tag)], before)
        host = torch.device("cpu") if self._side_groups else self.device  # the check group is gloo's
        mine = torch.tensor(tag, dtype=torch.int64, device=host)
        everyone = torch.empty(self.world_size * len(tag), dtype=torch.int64, device=host)
        entry = LOG.issue("check", "order check before the all-gather of" if what is not None else "order check", what)
        work = dist.all_gather_single(everyone, mine, group=self.check_group, async_op=True)
        self.checks += 1
        nbytes = everyone.numel() * everyone.element_size()
        checks = self._by_group.setdefault(("check", "check"), CollectiveStats())
        checks.add(nbytes, 0.0, 0.0, self._inter_node("check", nbytes, "check"))  # its time is the gather's
        return Agreement(self, work, everyone.view(self.world_size, len(tag)), before, entry)

    @property
    def device(self) -> torch.device:
        """Where this group's collectives run: the current CUDA device under NCCL (one rank too: an NCCL
        group cannot move host tensors), the host otherwise."""
        if dist.is_available() and dist.is_initialized() and dist.get_backend(self.group) == "nccl":
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
                ways += self._pair_ways()
                warm = [self._call_once(kind, way, full, shard) for way in ways]  # each way's first call here
                rounds = 1 if min(self._slowest(warm)) >= LONG_CALL else repeats  # [Note: long calls are timed once]
                samples: dict[str, list[float]] = {way: [] for way in ways}
                for _ in range(rounds):  # the ways in turn, so that a slow spell hits them all alike
                    for way in ways:
                        samples[way].append(self._call_once(kind, way, full, shard))
                worst = self._slowest([statistics.median(samples[way]) for way in ways])  # every rank decides alike
                self.choice[(kind, nbytes)] = ways[worst.index(min(worst))]
        self.reset_stats()  # tuning traffic is not training traffic

    def _call_once(self, kind: str, way: str, full: torch.Tensor, shard: torch.Tensor) -> float:
        """Seconds of one ``kind`` call done ``way`` (on the host's clock, to the end of the device's work)."""
        self.choice[(kind, full.numel() * full.element_size())] = way
        return self._time(kind, full, shard, 0, 1, recorded=False)[0]

    def _slowest(self, seconds: list[float]) -> list[float]:
        """Each figure's maximum over the ranks (the same list on every rank)."""
        worst = torch.tensor(seconds, dtype=torch.float64, device=self.device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=self.group)
        return worst.tolist()

    def reset_stats(self) -> None:
        self._timings.clear()
        self._stats = {kind: CollectiveStats() for kind in self.KINDS}
        self._by_size = {}
        self._by_group = {}
        self._dtypes = {}

    # -- [Note: peak bandwidth] ----------------------------------------------------------------------

    def measure_peaks(self, repeats: int = 5, warmup: int = 2) -> dict[tuple[str, int], float]:
        """Peak busbw (bytes/s) of every (kind, size) used so far and not measured yet, measured now on this
        group (a collective: every rank must call it at the same point, after running the same collectives)."""
        self.settle()  # training's waited collectives go to training's totals
        saved = self._stats, self._by_size, self._dtypes, self._by_group
        self.reset_stats()
        for kind, nbytes in sorted(saved[1]):  # the same order on every rank
            if (kind, nbytes) in self.peak_busbw:
                continue
            dtype = saved[2][(kind, nbytes)]
            full = torch.zeros(nbytes // dtype.itemsize, dtype=dtype, device=self.device)
            shard = full[: full.numel() // self.world_size].clone()
            mine = statistics.median(self._time(kind, full, shard, warmup, repeats, recorded=True))
            seconds = torch.tensor([mine], dtype=torch.float64, device=self.device)
            if self.distributed:
                dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=self.group)  # the slowest rank's median
            self.peak_busbw[(kind, nbytes)] = nbytes / max(float(seconds), 1e-9) * self.bus_factor(kind)
        self.reset_stats()
        self._stats, self._by_size, self._dtypes, self._by_group = saved  # measuring traffic is not training traffic
        return dict(self.peak_busbw)

    def _time(
        self, kind: str, full: torch.Tensor, shard: torch.Tensor, warmup: int, repeats: int, recorded: bool
    ) -> list[float]:
        """Seconds of each of ``repeats`` synchronous calls, after ``warmup`` untimed ones. ``recorded``: as
        the accounting times a collective in training ([Note: completion time]); otherwise on the host's
        clock from the call to the end of the device's work."""
        samples, key = [], (kind, full.numel() * full.element_size())
        for call in range(warmup + repeats):
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
            self.clock.synchronize()  # each call alone on the group
            elapsed = time.perf_counter() - start
            if call >= warmup:
                samples.append(self.by_size[key].seconds - before if recorded else elapsed)
        return samples
