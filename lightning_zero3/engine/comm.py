"""The one place that issues collectives.

Every byte zero3 moves between ranks goes through a ``Communicator``. It records, per collective kind,
how many calls, how many bytes and how many seconds, so the figures that monitoring reports are true by
construction. Bytes are counted as nccl-tests counts them: the size of the full (gathered, or
pre-scatter) buffer, for every rank alike.

With a world of one rank the collectives are plain copies: the engine runs the same code path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist


@dataclass
class CollectiveStats:
    """Totals for one collective kind since the engine started."""

    count: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def add(self, nbytes: int, seconds: float) -> None:
        self.count += 1
        self.bytes += nbytes
        self.seconds += seconds


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

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor) -> None:
        """Fill ``output`` (``world_size * shard.numel()`` elements) with every rank's ``shard`` in rank order."""
        start = time.perf_counter()
        if self.distributed:
            dist.all_gather_single(output, shard, group=self.group)
        else:
            output.copy_(shard)
        self.stats["all_gather"].add(output.numel() * output.element_size(), time.perf_counter() - start)

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor) -> None:
        """Sum ``full`` over ranks and leave this rank's slice of the sum in ``output``."""
        start = time.perf_counter()
        if self.distributed:
            dist.reduce_scatter_single(output, full, op=dist.ReduceOp.SUM, group=self.group)
        else:
            output.copy_(full)
        self.stats["reduce_scatter"].add(full.numel() * full.element_size(), time.perf_counter() - start)

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        start = time.perf_counter()
        if self.distributed:
            dist.all_reduce(tensor, op=op, group=self.group)
        self.stats["all_reduce"].add(tensor.numel() * tensor.element_size(), time.perf_counter() - start)
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        start = time.perf_counter()
        if self.distributed:
            dist.broadcast(tensor, src=dist.get_global_rank(self.group, src) if self.group else src, group=self.group)
        self.stats["broadcast"].add(tensor.numel() * tensor.element_size(), time.perf_counter() - start)
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
        both = torch.tensor([value, -value], dtype=torch.int64, device=self._device())
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        return int(both[0]) == value and int(-both[1]) == value

    def _device(self) -> torch.device:
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
