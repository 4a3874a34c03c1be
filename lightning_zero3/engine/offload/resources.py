"""One engine's offload: the shared tiers (``tiers.py``) plus every group's store and source.

A group's own storage lives in ``store.py`` (master, gradient, optimizer state) and ``source.py`` (what
its all-gathers read); the engine walks groups with ``streaming.py``.
"""

from __future__ import annotations

import torch

from ..memory.buffers import OFFLOAD_NVME, ByteLedger
from .source import ParamSource
from .store import GroupStore
from .tiers import OffloadTiers


class Offload(OffloadTiers):
    """The shared tiers plus every group's store and source, and the end of it all."""

    def __init__(self, config, ledger: ByteLedger, device: torch.device, rank: int) -> None:
        super().__init__(config, ledger, device, rank)
        self.stores: list[GroupStore] = []
        self.sources: list[ParamSource] = []

    def new_store(self, initial: torch.Tensor, trainable: bool) -> GroupStore:
        store = GroupStore(self, len(self.stores), initial, trainable)
        self.stores.append(store)
        return store

    def new_source(self, store: GroupStore, shard: torch.Tensor, aliased: bool = False) -> ParamSource:
        source = ParamSource(store, shard, self.ledger, aliased)
        self.sources.append(source)
        return source

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
