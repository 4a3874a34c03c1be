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
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
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

    def __init__(self, work: Any, stats: CollectiveStats, nbytes: int, finish: Optional[Callable[[], None]]) -> None:
        self._work = work
        self._stats = stats
        self._nbytes = nbytes
        self._finish = finish
        self._issued = time.perf_counter()
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        start = time.perf_counter()
        if self._work is not None:
            self._work.wait()
        if self._finish is not None:
            self._finish()
        end = time.perf_counter()
        self._stats.add(self._nbytes, end - self._issued, end - start)
        self.done = True


# The ways of doing each collective that ``tune`` chooses between.
ALL_GATHER_WAYS = ("all_gather_single", "all_gather_list")
REDUCE_SCATTER_WAYS = ("reduce_scatter_single", "all_reduce_slice")


class Communicator:
    """Collectives over one process group (the data-parallel group), with byte and time accounting."""

    KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")

    def __init__(self, group: Optional[dist.ProcessGroup] = None) -> None:
        self.group = group
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
        else:
            self.rank, self.world_size = 0, 1
        self.stats = {kind: CollectiveStats() for kind in self.KINDS}
        self.choice: dict[tuple[str, int], str] = {}  # (kind, bytes of the full buffer) -> way, by ``tune``

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    # -- sharding collectives (sync or async) -----------------------------------------------------

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, async_op: bool = False) -> Optional[Pending]:
        """Fill ``output`` (``world_size * shard.numel()`` elements) with every rank's ``shard`` in rank order."""
        nbytes = output.numel() * output.element_size()
        if not self.distributed:
            output.copy_(shard)
            return self._finish(Pending(None, self.stats["all_gather"], nbytes, None), async_op)
        way = self.choice.get(("all_gather", nbytes), ALL_GATHER_WAYS[0])
        if way == "all_gather_list":
            work = dist.all_gather(list(output.chunk(self.world_size)), shard, group=self.group, async_op=True)
        else:
            work = dist.all_gather_single(output, shard, group=self.group, async_op=True)
        return self._finish(Pending(work, self.stats["all_gather"], nbytes, None), async_op)

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor, async_op: bool = False) -> Optional[Pending]:
        """Sum ``full`` over ranks and leave this rank's slice of the sum in ``output``."""
        nbytes = full.numel() * full.element_size()
        if not self.distributed:
            output.copy_(full)
            return self._finish(Pending(None, self.stats["reduce_scatter"], nbytes, None), async_op)
        way = self.choice.get(("reduce_scatter", nbytes), REDUCE_SCATTER_WAYS[0])
        finish = None
        if way == "all_reduce_slice":
            work = dist.all_reduce(full, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            start = self.rank * output.numel()
            finish = lambda: output.copy_(full[start : start + output.numel()])  # noqa: E731
        else:
            work = dist.reduce_scatter_single(output, full, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return self._finish(Pending(work, self.stats["reduce_scatter"], nbytes, finish), async_op)

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
        self.stats["all_reduce"].add(tensor.numel() * tensor.element_size(), elapsed, elapsed)
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        start = time.perf_counter()
        if self.distributed:
            dist.broadcast(tensor, src=dist.get_global_rank(self.group, src) if self.group else src, group=self.group)
        elapsed = time.perf_counter() - start
        self.stats["broadcast"].add(tensor.numel() * tensor.element_size(), elapsed, elapsed)
        return tensor

    def all_gather_objects(self, obj: Any) -> list:
        """Every rank's ``obj``, in rank order. For small Python objects (layouts, scalars), never weights."""
        if not self.distributed:
            return [obj]
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, obj, group=self.group)
        return everyone

    def all_equal(self, value: int) -> bool:
        """Whether every rank passed the same integer (used to check that ranks agree before acting)."""
        if not self.distributed:
            return True
        both = torch.tensor([value, -value], dtype=torch.int64, device=self.device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        return int(both[0]) == value and int(-both[1]) == value

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
        self.stats = {kind: CollectiveStats() for kind in self.KINDS}  # tuning traffic is not training traffic

    def _time(self, kind: str, full: torch.Tensor, shard: torch.Tensor, repeats: int) -> float:
        samples = []
        for _ in range(repeats + 1):  # the first call warms up
            start = time.perf_counter()
            if kind == "all_gather":
                self.all_gather(full, shard)
            else:
                self.reduce_scatter(shard, full)
            if full.is_cuda:
                torch.cuda.synchronize(full.device)
            samples.append(time.perf_counter() - start)
        return statistics.median(samples[1:])
