"""The device-side source of a group's all-gathers under offload, per parameter tier.

The optimizer steps the master in the optimizer tier (``store.py``); the all-gather needs this rank's
shard on the training device. ``offload_params`` says where that copy lives between uses:

- ``None``: on the device, refreshed from the master after every step (``publish``);
- ``"cpu"``: freed on the device between uses and uploaded from host memory just before the all-gather
  (from the master itself in the host tier, or from a host copy of it when the master is on NVMe);
- ``"nvme"``: freed on the device; read from the master's swap file ahead of use (``prefetch``, following
  the recorded execution order) and uploaded just before the all-gather.

Every upload reads a host buffer on the copy engine (see [Note: device-to-host copies are events] in
store.py): its event is handed to the store (``note_reader``), which waits for it before the next step
writes the master.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Optional

import torch

from ...config.settings import OffloadTier
from ..memory.buffers import OFFLOAD_HOST, PARAM_SHARDS, ByteLedger, host_buffer, reclaim, release
from .store import MASTER, GroupStore


class ParamSource:
    def __init__(self, store: GroupStore, shard: torch.Tensor, ledger: ByteLedger, aliased: bool = False) -> None:
        self.store = store
        # the shard is the group's gathered buffer itself (one process: see FlatGroup._alias_shard_and_full):
        # its pages belong to the group, which releases them; here only reads ahead of the gather are counted
        self.aliased = aliased
        self.offload = store.offload
        self.tier = self.offload.param_tier
        self.shard = shard
        self.ledger = ledger
        self.nbytes = shard.numel() * shard.element_size()
        self.host_copy: Optional[torch.Tensor] = None  # the gather source in host memory (nvme master, cpu params)
        self.pending_read: Optional[tuple[Future, torch.Tensor]] = None  # nvme read-ahead
        self.publish_event = None  # master -> device shard (tier None), waited for by the all-gather
        self.filled = True  # the device shard holds valid values (always so for tier None)
        if self.tier == OffloadTier.CPU and self.offload.nvme:
            self.host_copy = host_buffer(store.numel, store.dtype)
            self.ledger.add(OFFLOAD_HOST, self.nbytes)
            self.host_copy.copy_(shard)  # the initial master values (the store may have swapped them out)
        if self.aliased:
            self.filled = False
        elif self.tier is not None:
            self._free()

    def _free(self) -> None:
        if not self.aliased:
            release(self.shard)
        self.ledger.remove(PARAM_SHARDS, self.nbytes)
        self.filled = False

    def publish(self) -> None:
        """After the (resident) master changed: refresh what all-gathers read from."""
        if self.tier is None:
            self.publish_event = self.offload.copies.copy(self.shard, self.store.master)
            self.store.note_reader(self.publish_event)
        elif self.host_copy is not None:
            self.host_copy.copy_(self.store.master)

    def refresh(self) -> None:
        """The master changed in its tier behind the step's back (a checkpoint was loaded): bring what
        all-gathers read up to date, reading the master from its swap file if need be."""
        if self.tier == OffloadTier.NVME or (self.tier == OffloadTier.CPU and not self.offload.nvme):
            return  # the all-gather reads the master itself, just in time
        pooled = None
        master = self.store.master
        if master is None:
            future, pooled = self.store.read_file(MASTER)
            self.offload.io.wait(future)
            master = pooled
        if self.tier is None:
            self.offload.copies.wait_on_host(self.offload.copies.copy(self.shard, master))
        else:
            self.host_copy.copy_(master)
        if pooled is not None:
            self.offload.host.give(pooled)

    def prefetch(self) -> None:
        """Read the parameter shard from its swap file ahead of the all-gather that needs it. On a host
        device the read lands in the shard itself (no staging buffer, no copy); a device read needs a host
        buffer to land in first."""
        if self.tier != OffloadTier.NVME or self.store.resident or self.pending_read is not None:
            return
        if self.shard.device.type == "cpu" and not self.offload.copies.cuda:
            self._claim()
            self.pending_read = (self.store.read_into(MASTER, self.shard), None)
        else:
            self.pending_read = self.store.read_file(MASTER)

    def still_reading(self) -> bool:
        """A read-ahead of the shard is still on its way from the disk (``fill`` would wait for it)."""
        return self.pending_read is not None and not self.pending_read[0].done()

    def _claim(self) -> None:
        if not self.filled:
            reclaim(self.shard)
            self.ledger.add(PARAM_SHARDS, self.nbytes)
            self.filled = True

    def fill(self) -> torch.Tensor:
        """Make the device shard valid for an all-gather; returns it."""
        copies = self.offload.copies
        if self.tier is None:
            copies.wait_on_device(self.publish_event)
            return self.shard
        if self.pending_read is None or self.pending_read[1] is not None:
            self._claim()
        if self.store.resident or self.tier == OffloadTier.CPU:
            source = self.store.master if self.store.resident else self.host_copy
            event = copies.copy(self.shard, source)
            copies.wait_on_device(event)
            self.store.note_reader(event)  # the next step must not write the master under the copy
            return self.shard
        self.prefetch()
        assert self.pending_read is not None
        future, buffer = self.pending_read
        self.pending_read = None
        self.offload.io.wait(future)
        if buffer is None:  # read straight into the shard
            return self.shard
        event = copies.copy(self.shard, buffer)
        copies.wait_on_device(event)
        copies.wait_on_host(event)  # the buffer goes back to the pool: the copy must have read it
        self.offload.host.give(buffer)
        return self.shard

    def after_gather(self) -> None:
        """After the all-gather read the device shard: free it again (parameters offloaded)."""
        if self.tier is not None and self.filled:
            self._free()

    def drain(self) -> None:
        """Wait for a read-ahead in flight and give its buffer back."""
        if self.pending_read is not None:
            future, buffer = self.pending_read
            self.offload.io.wait(future)
            if buffer is not None:
                self.offload.host.give(buffer)
            elif self.aliased:  # read ahead for a gather that did not come: the group is not gathered
                release(self.shard)
                self._free()
            self.pending_read = None

    def close(self) -> None:
        self.drain()
        if self.host_copy is not None:
            self.ledger.remove(OFFLOAD_HOST, self.nbytes)
            self.host_copy = None
