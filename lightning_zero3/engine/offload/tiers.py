"""Storage tiers for one flat group's master shard, gradient shard and optimizer state.

Without offload a group keeps everything on the training device: ``group.shard`` is the master shard
the optimizer steps (through the per-parameter ``shard_param`` views) and the source of all-gathers.
Under offload (``GroupStore``) the two roles split:

- the **master** (the tensor ``shard_param`` views point into), the gradient shard and the optimizer
  state live in the optimizer tier: host memory (``"cpu"``) or swap files (``"nvme"``);
- ``group.shard`` stays the device-side *gather source*. With ``offload_params=None`` it is kept on the
  device and refreshed from the master after every step; with ``"cpu"`` / ``"nvme"`` its memory is
  freed between uses and refilled from the parameter tier just before the all-gather (from the host
  master, a host copy, or the master's swap file, read ahead following the execution trace).

[Note: NVMe-tier residency]
Under ``offload_optimizer="nvme"`` a group is *resident* only while it is stepped (or inside
``engine.states_in_memory()``): its master, gradient and per-element optimizer state (Adam's moments)
are read into fresh host buffers, the shard parameters' ``.data`` / ``.grad`` and the optimizer's state
entries are pointed at slices of them, and afterwards everything is written back and the buffers
dropped. Between uses a shard parameter holds a 0-element placeholder (``.data``), its state entries
0-element placeholders (so ``optimizer_state_bytes`` counts what is really in memory and any stray
read fails loudly rather than reading stale numbers), and ``.grad`` a 0-element *marker* while its
gradient waits on disk. ``zero_grad()`` sets ``.grad`` to None (or zeroes the marker, which bumps its
version counter): either way the next backward starts a fresh gradient instead of adding to the old one.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Optional

import torch

from ..memory import OFFLOAD_HOST, OFFLOAD_NVME, PARAM_SHARDS, ByteLedger, free_storage, restore_storage
from .aio import AsyncFileIO
from .copies import DeviceHostCopies
from .swapdir import SwapDirectory

if TYPE_CHECKING:
    from ..shard import FlatGroup

IO_THREADS = 4  # file requests in flight at once: the disk's queue depth


class Offload:
    """What one engine's groups share under offload: tiers, copies, the swap folder and its I/O."""

    def __init__(self, config, ledger: ByteLedger, device: torch.device, rank: int) -> None:
        self.optimizer_tier: str = config.offload_optimizer
        self.param_tier: Optional[str] = config.offload_params
        self.ledger = ledger
        self.copies = DeviceHostCopies(device, config.offload_pin_memory)
        self.buffer_count = config.offload_buffer_count
        self.nvme = self.optimizer_tier == "nvme"
        self.swap = SwapDirectory(config.nvme_path, rank) if self.nvme else None
        self.io = AsyncFileIO(config.offload_buffer_size * 4, threads=IO_THREADS) if self.nvme else None
        self.stores: list[GroupStore] = []
        self.writing: list[GroupStore] = []  # groups with writes in flight, oldest first
        self.pool: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}  # free host buffers

    def new_store(self, shard: torch.Tensor, trainable: bool) -> "GroupStore":
        store = GroupStore(self, len(self.stores), shard, trainable)
        self.stores.append(store)
        return store

    def check_room(self, nbytes: int, what: str) -> None:
        if self.swap is not None:
            self.swap.check_room(nbytes, what)

    def throttle(self, limit: int) -> None:
        """Wait for the oldest groups' writes until at most ``limit`` groups have writes in flight (each
        holds its host buffers until its writes complete)."""
        self.writing = [s for s in dict.fromkeys(self.writing) if s.writes]
        while len(self.writing) > limit:
            self.writing.pop(0).drain()

    def host_alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer: a free one of this size from the pool, else a new one (see ``host_free``)."""
        free = self.pool.get((numel, dtype))
        if free:
            return free.pop()
        tensor = self.copies.host_empty(numel, dtype)
        self.ledger.add(OFFLOAD_HOST, numel * tensor.element_size())
        return tensor

    def host_free(self, tensor: torch.Tensor) -> None:
        """Give a buffer back once nothing reads or writes it any more. Up to ``2 * buffer_count`` stay in
        a pool (and in the ledger): reusing them spares the page faults of fresh memory on every swap."""
        if sum(map(len, self.pool.values())) < 2 * self.buffer_count:
            self.pool.setdefault((tensor.numel(), tensor.dtype), []).append(tensor)
        else:
            self.ledger.remove(OFFLOAD_HOST, tensor.numel() * tensor.element_size())

    def close(self) -> None:
        for store in self.stores:
            store.drain()
        if self.io is not None:
            self.io.close()
        for buffers in self.pool.values():
            for buffer in buffers:
                self.ledger.remove(OFFLOAD_HOST, buffer.numel() * buffer.element_size())
        self.pool = {}
        if self.swap is not None:
            self.ledger.remove(OFFLOAD_NVME, self.ledger.held[OFFLOAD_NVME])
            self.swap.remove()


class GroupStore:
    """One group's master, gradient and optimizer state in the offload tiers (see the module notes)."""

    def __init__(self, offload: Offload, index: int, shard: torch.Tensor, trainable: bool) -> None:
        self.offload = offload
        self.name = f"g{index}"
        self.numel, self.dtype = shard.numel(), shard.dtype
        self.nbytes = shard.numel() * shard.element_size()
        self.trainable = trainable
        self.group: Optional["FlatGroup"] = None
        self.master = offload.host_alloc(self.numel, self.dtype)
        with torch.no_grad():
            self.master.copy_(shard)
        self.grad: Optional[torch.Tensor] = None  # the gradient shard, while in memory
        self.grad_events: list = []  # device -> host gradient copies in flight ("cpu" tier)
        self.publish_event = None  # master -> device copy in flight (offload_params=None)
        self.host_params: Optional[torch.Tensor] = None  # gather source kept on the host (nvme master, cpu params)
        self.files: dict = {}
        self.writes: dict[str, Future] = {}  # kind -> the last write of that file, with its buffer
        self.reads: dict[str, tuple[Future, torch.Tensor]] = {}
        self.param_read: Optional[tuple[Future, torch.Tensor]] = None
        self.state_dtypes: dict[str, torch.dtype] = {}  # per-element optimizer-state keys on disk
        self.grad_on_disk = False
        self.markers: dict[int, tuple[torch.Tensor, int]] = {}
        self.resident = True
        self.states: dict[str, torch.Tensor] = {}  # per-element state buffers, while resident
        self.optimizers: list[torch.optim.Optimizer] = []  # set by the engine as optimizers are sharded
        if trainable and not offload.nvme:
            self.grad = offload.host_alloc(self.numel, self.dtype)

    # -- set-up ------------------------------------------------------------------------------------

    def bind(self, group: "FlatGroup") -> None:
        """Called once the group's slots exist (their shard parameters view ``self.master``)."""
        self.group = group
        if self.offload.param_tier == "cpu" and self.offload.nvme:
            self.host_params = self.offload.host_alloc(self.numel, self.dtype)
            self.host_params.copy_(self.master)
        if self.offload.param_tier is not None:
            free_storage(group.shard)
            group.ledger.remove(PARAM_SHARDS, self.nbytes)
        if self.offload.nvme:
            self._file("master", self.dtype)
            if self.trainable:
                self._file("grad", self.dtype)
            self._write("master", self.master)
            self._evict()
            self.offload.throttle(self.offload.buffer_count)

    def _file(self, kind: str, dtype: torch.dtype):
        nbytes = self.numel * torch.empty((), dtype=dtype).element_size()
        self.files[kind] = self.offload.swap.create(f"{self.name}-{kind}", nbytes)
        self.offload.ledger.add(OFFLOAD_NVME, nbytes)
        return self.files[kind]

    # -- file transfers (NVMe tier) -----------------------------------------------------------------

    def _write(self, kind: str, buffer: torch.Tensor, ready=None) -> None:
        self._settle(kind)
        self.writes[kind] = self.offload.io.write(self.files[kind], buffer, ready=ready)
        self.offload.writing.append(self)

    def _settle(self, kind: str) -> None:
        """Wait for the last write of ``kind`` (a read or a new write of that file must come after it)."""
        future = self.writes.pop(kind, None)
        if future is not None:
            buffer = self.offload.io.wait(future)
            self.offload.host_free(buffer)

    def drain(self) -> None:
        """Wait for every write in flight and give its buffer back."""
        for kind in list(self.writes):
            self._settle(kind)
        if self.param_read is not None:
            future, buffer = self.param_read
            self.offload.io.wait(future)
            self.offload.host_free(buffer)
            self.param_read = None

    def has_gradient(self) -> bool:
        """Whether the optimizer has anything to do for this group this step."""
        if self.offload.nvme and not self.resident:
            return self.grad_on_disk and not self._grads_fresh()
        return any(slot.shard_param.grad is not None for slot in self.group.trainable_slots)

    def _read(self, kind: str, dtype: torch.dtype) -> None:
        self._settle(kind)
        buffer = self.offload.host_alloc(self.numel, dtype)
        self.reads[kind] = (self.offload.io.read(self.files[kind], buffer), buffer)

    # -- residency (NVMe tier) ----------------------------------------------------------------------

    def start_load(self) -> None:
        """Issue the reads that make this group resident (master, gradient if one waits, state)."""
        if not self.offload.nvme or self.resident or self.reads:
            return
        if self.grad_on_disk and self._grads_fresh():
            self.grad_on_disk = False  # zero_grad ran: the gradient on disk is stale
        self._read("master", self.dtype)
        if self.grad_on_disk:
            self._read("grad", self.dtype)
        for key, dtype in self.state_dtypes.items():
            self._read(f"state-{key}", dtype)

    def attach(self) -> None:
        """Wait for the reads and point shard parameters, gradients and state at the buffers."""
        self.wait_grads()
        self.offload.copies.wait_on_host(self.publish_event)  # the last master -> device copy read it
        if not self.offload.nvme or self.resident:
            return
        self.start_load()
        buffers = {kind: self.offload.io.wait(future) for kind, (future, _) in self.reads.items()}
        self.reads = {}
        self.master = buffers.pop("master")
        self.grad = buffers.pop("grad", None)
        states = {kind[len("state-") :]: buffer for kind, buffer in buffers.items()}
        optimizer_state = self._optimizer_states()
        for slot in self.group.slots:
            p = slot.shard_param
            p.grad = None
            p.data = self.master[slot.lo : slot.hi]
            if self.grad is not None and slot.param.requires_grad:
                p.grad = self.grad[slot.lo : slot.hi]
            for state in optimizer_state:
                entry = state.get(p)
                for key, buffer in states.items():
                    if entry is not None and key in entry:
                        entry[key] = buffer[slot.lo : slot.hi]
        self.states = states
        self.resident = True

    def store(self, write_grad: bool = False) -> None:
        """Write the resident group back (master, new or changed state; the gradient if asked) and evict it."""
        if not self.offload.nvme or not self.resident:
            return
        states = self.states
        for state in self._optimizer_states():
            for slot in self.group.slots:
                entry = state.get(slot.shard_param)
                for key, value in (entry or {}).items():
                    if not _per_element(value, slot):
                        continue
                    if key not in states:
                        states[key] = self.offload.host_alloc(self.numel, value.dtype)
                        states[key].zero_()
                        if key not in self.state_dtypes:
                            self.state_dtypes[key] = value.dtype
                            self._file(f"state-{key}", value.dtype)
                    target = states[key][slot.lo : slot.hi]
                    if value.data_ptr() != target.data_ptr():
                        target.copy_(value.reshape(-1))
        self._write("master", self.master)
        for key, buffer in states.items():
            self._write(f"state-{key}", buffer)
        if self.grad is not None:
            if write_grad:
                self._write("grad", self.grad)
            else:
                self.offload.host_free(self.grad)
        self.states = {}
        self._evict()

    def _evict(self) -> None:
        """Placeholders in place of everything now on disk (see [Note: NVMe-tier residency])."""
        empty = torch.empty(0, dtype=self.dtype)
        for state in self._optimizer_states():
            for slot in self.group.slots:
                entry = state.get(slot.shard_param)
                for key in self.state_dtypes:
                    if entry is not None and key in entry:
                        entry[key] = torch.empty(0, dtype=self.state_dtypes[key])
        for slot in self.group.slots:
            p = slot.shard_param
            p.grad = None
            p.data = empty
            if self.grad_on_disk and slot.param.requires_grad and id(p) in self.markers:
                marker = torch.empty(0, dtype=self.dtype)
                p.grad = marker
                self.markers[id(p)] = (marker, marker._version)
        self.master = None
        self.grad = None
        self.resident = False

    def _optimizer_states(self) -> list[dict]:
        return [optimizer.state for optimizer in self.optimizers]

    # -- gradients -----------------------------------------------------------------------------------

    def _grads_fresh(self) -> bool:
        """True when the next reduced gradient replaces the stored one (``zero_grad`` ran since)."""
        for slot in self.group.trainable_slots:
            p = slot.shard_param
            marker = self.markers.get(id(p))
            if p.grad is None or marker is None or p.grad is not marker[0] or marker[0]._version != marker[1]:
                return True
        return False

    def accumulate(self, reduced: torch.Tensor) -> None:
        """Add this rank's reduced gradient slice (on the device) into the group's gradient shard."""
        copies = self.offload.copies
        if not self.offload.nvme:
            for slot in self.group.trainable_slots:
                if slot.hi == slot.lo:
                    continue
                p, piece = slot.shard_param, reduced[slot.lo : slot.hi]
                if p.grad is None:
                    view = self.grad[slot.lo : slot.hi]
                    self.grad_events.append(copies.copy(view, piece))
                    p.grad = view
                else:
                    self.wait_grads()
                    p.grad.add_(piece.to(p.grad.device))
            return
        if self.resident:  # inside states_in_memory(): plain in-memory accumulation
            self._accumulate_resident(reduced)
            return
        host = self.offload.host_alloc(self.numel, self.dtype)
        event = copies.copy(host, reduced)
        if self.grad_on_disk and not self._grads_fresh():
            self._read("grad", self.dtype)
            future, stored = self.reads.pop("grad")
            self.offload.io.wait(future)
            copies.wait_on_host(event)
            host.add_(stored)
            self.offload.host_free(stored)
            event = None
        self._write("grad", host, ready=lambda: copies.wait_on_host(event))
        self.offload.throttle(self.offload.buffer_count)
        self.grad_on_disk = True
        for slot in self.group.trainable_slots:
            marker = torch.empty(0, dtype=self.dtype)
            slot.shard_param.grad = marker
            self.markers[id(slot.shard_param)] = (marker, marker._version)

    def _accumulate_resident(self, reduced: torch.Tensor) -> None:
        if self.grad is None or self._grads_fresh():
            if self.grad is None:
                self.grad = self.offload.host_alloc(self.numel, self.dtype)
            self.grad.zero_()
        self.grad.add_(reduced.to(self.grad.device))
        self.grad_on_disk = True
        for slot in self.group.trainable_slots:
            slot.shard_param.grad = self.grad[slot.lo : slot.hi]
            self.markers[id(slot.shard_param)] = (slot.shard_param.grad, slot.shard_param.grad._version)

    def wait_grads(self) -> None:
        for event in self.grad_events:
            self.offload.copies.wait_on_host(event)
        self.grad_events = []

    # -- the gather source -----------------------------------------------------------------------------

    def publish(self) -> None:
        """After the master changed: refresh what all-gathers read from (device copy or host copy)."""
        if self.offload.param_tier is None:
            self.publish_event = self.offload.copies.copy(self.group.shard, self.master)
        elif self.host_params is not None:
            self.host_params.copy_(self.master)

    def prefetch_params(self) -> None:
        """Read the parameter shard from its swap file ahead of the all-gather that needs it."""
        if self.offload.param_tier != "nvme" or self.resident or self.param_read is not None:
            return
        self._settle("master")
        buffer = self.offload.host_alloc(self.numel, self.dtype)
        self.param_read = (self.offload.io.read(self.files["master"], buffer), buffer)

    def fill(self, shard: torch.Tensor) -> torch.Tensor:
        """Make the device shard valid for an all-gather; returns it."""
        copies = self.offload.copies
        if self.offload.param_tier is None:
            copies.wait_on_device(self.publish_event)
            return shard
        restore_storage(shard)
        self.group.ledger.add(PARAM_SHARDS, self.nbytes)
        if self.resident or self.offload.param_tier == "cpu":
            copies.wait_on_device(copies.copy(shard, self.master if self.resident else self.host_params))
            return shard
        self.prefetch_params()
        future, buffer = self.param_read
        self.param_read = None
        self.offload.io.wait(future)
        event = copies.copy(shard, buffer)
        copies.wait_on_device(event)
        copies.wait_on_host(event)  # the buffer goes back to the pool: the copy must have read it
        self.offload.host_free(buffer)
        return shard

    def unfill(self, shard: torch.Tensor) -> None:
        """After the all-gather: free the device shard again (parameters offloaded)."""
        if self.offload.param_tier is not None and shard.untyped_storage().size():
            free_storage(shard)
            self.group.ledger.remove(PARAM_SHARDS, self.nbytes)

    def require_resident(self, what: str) -> torch.Tensor:
        if not self.resident:
            raise RuntimeError(
                f"zero3: {what} needs the master shard of {self.group.name!r} in memory; wrap the call in "
                "`engine.states_in_memory()` (offload_optimizer='nvme')."
            )
        return self.master


def _per_element(value, slot) -> bool:
    return torch.is_tensor(value) and value.dim() > 0 and value.numel() == slot.hi - slot.lo and value.numel() > 0
