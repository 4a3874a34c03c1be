"""What one engine's offloaded groups share: the tiers chosen, the device <-> host copy engine, the swap
folder and its I/O threads, the pool of host buffers, and the bound on writes in flight.

A group's own storage lives in ``store.py`` (master, gradient, optimizer state) and ``source.py`` (what
its all-gathers read); the engine walks groups with ``streaming.py``.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..memory import OFFLOAD_HOST, OFFLOAD_NVME, BufferPool, ByteLedger
from .aio import AsyncFileIO
from .copies import DeviceHostCopies
from .source import ParamSource
from .store import GroupStore
from .swapdir import SwapDirectory

IO_THREADS = 4  # file requests in flight at once: the disk's queue depth

#: chosen so tests can run the offload code under a copy engine that completes copies late
COPY_ENGINE = DeviceHostCopies


class Offload:
    def __init__(self, config, ledger: ByteLedger, device: torch.device, rank: int) -> None:
        self.optimizer_tier: str = config.offload_optimizer
        self.param_tier: Optional[str] = config.offload_params
        self.ledger = ledger
        self.copies = COPY_ENGINE(device, config.offload_pin_memory, ledger)
        self.buffer_count = config.offload_buffer_count
        self.nvme = self.optimizer_tier == "nvme"
        self.swap = SwapDirectory(config.nvme_path, rank) if self.nvme else None
        self.io = AsyncFileIO(config.offload_buffer_size * 4, threads=IO_THREADS) if self.nvme else None
        # Host buffers for swap-ins, write-behind and staging. Idle ones are kept for reuse up to what
        # ``buffer_count`` groups need at once (set by ``plan_host_pool`` once the groups are known).
        self.host = BufferPool(ledger, OFFLOAD_HOST)
        self.stores: list[GroupStore] = []
        self.sources: list[ParamSource] = []
        self.writing: list[GroupStore] = []  # groups with writes in flight, oldest first

    def new_store(self, initial: torch.Tensor, trainable: bool) -> GroupStore:
        store = GroupStore(self, len(self.stores), initial, trainable)
        self.stores.append(store)
        return store

    def new_source(self, store: GroupStore, shard: torch.Tensor, aliased: bool = False) -> ParamSource:
        source = ParamSource(store, shard, self.ledger, aliased)
        self.sources.append(source)
        return source

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

    def settle(self) -> None:
        """Every write finished and every read-ahead returned: the swap files hold the current values."""
        for source in self.sources:
            source.drain()
        self.throttle(0)

    def close(self) -> None:
        self.settle()
        for source in self.sources:
            source.close()
        if self.io is not None:
            self.io.close()
        self.host.trim()
        if self.copies.staging is not None:
            self.copies.staging.trim()
        for store in self.stores:
            store.close()
        if self.swap is not None:
            self.ledger.remove(OFFLOAD_NVME, self.ledger.held[OFFLOAD_NVME])
            self.swap.remove()
