"""The offload resources one engine's groups share: the tiers chosen, the device <-> host copy engine,
the swap folder and its I/O threads, the pool of host buffers, and the bound on writes in flight.

A group's ``GroupStore`` (``store.py``) holds these; ``resources.Offload`` adds the list of stores and
sources and the end of it all. Imports: ``memory`` and this folder's leaves only.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ...config.settings import OffloadTier
from ..memory.buffers import OFFLOAD_HOST, BufferPool, ByteLedger
from .aio import AsyncFileIO
from .copies import DeviceHostCopies
from .swapdir import SwapDirectory

IO_THREADS = 4  # file requests in flight at once: the disk's queue depth

#: chosen so tests can run the offload code under a copy engine that completes copies late
COPY_ENGINE = DeviceHostCopies


class OffloadTiers:
    def __init__(self, config, ledger: ByteLedger, device: torch.device, rank: int) -> None:
        self.optimizer_tier: OffloadTier = config.offload_optimizer
        self.param_tier: Optional[OffloadTier] = config.offload_params
        self.ledger = ledger
        self.copies = COPY_ENGINE(device, config.offload_pin_memory, ledger)
        self.buffer_count = config.offload_buffer_count
        self.nvme = self.optimizer_tier == OffloadTier.NVME
        self.swap = SwapDirectory(config.nvme_path, rank) if self.nvme else None
        self.io = AsyncFileIO(config.offload_buffer_size * 4, threads=IO_THREADS) if self.nvme else None
        # Host buffers for swap-ins, write-behind and staging. Idle ones are kept for reuse up to what
        # ``buffer_count`` groups need at once (set by ``plan_host_pool`` once the groups are known).
        self.host = BufferPool(ledger, OFFLOAD_HOST)
        self.writing: list[Any] = []  # ``GroupStore``s with writes in flight, oldest first

    def plan_host_pool(self, group_bytes: list[int]) -> None:
        """Bound the idle host buffers: ``buffer_count`` of the largest groups' master, gradient and two
        state buffers each (what a pipelined step holds at once)."""
        largest = max(group_bytes, default=0)
        self.host.keep_bytes = self.buffer_count * 4 * largest

    def check_room(self, nbytes: int, what: str) -> None:
        if self.swap is not None:
            self.swap.check_room(nbytes, what)

    def throttle(self, limit: int) -> None:
        """Wait for the oldest groups' writes until at most ``limit`` groups have writes in flight (each
        holds its host buffers until its writes complete)."""
        self.writing = [s for s in dict.fromkeys(self.writing) if s.writes]
        while len(self.writing) > limit:
            self.writing.pop(0).drain()
