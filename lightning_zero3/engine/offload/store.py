"""One flat group's master shard, gradient shard and optimizer state in the optimizer tier.

Without offload a group keeps everything on the training device. Under offload the *master* (the tensor
the shard parameters view and the optimizer steps), the gradient shard and the per-element optimizer
state (Adam's moments) live in the optimizer tier: host memory (``"cpu"``) or swap files (``"nvme"``).
The group hands its store the views it needs when both are built (``ShardView``: a shard parameter and
its range in the flat shard) and then only calls this class; the store never looks back at the group.

[Note: NVMe-tier residency]
Under ``offload_optimizer="nvme"`` a group is *resident* only while it is stepped (or inside
``engine.states_in_memory()``): its master, gradient and optimizer state are read into host buffers,
the shard parameters' ``.data`` / ``.grad`` and the optimizer's state entries are pointed at slices of
them, and afterwards everything is written back and the buffers returned. Between uses a shard
parameter holds a 0-element placeholder (``.data``), its state entries 0-element placeholders (so
``optimizer_state_bytes`` counts what is really in memory and a stray read fails loudly rather than
reading stale numbers), and ``.grad`` a 0-element *marker* while its gradient waits on disk.
``zero_grad()`` sets ``.grad`` to None (or zeroes the marker, which bumps its version counter): either
way the next backward starts a fresh gradient instead of adding to the old one.

[Note: deferred gradient operations]
Clipping and fp16 unscaling change every gradient; under NVMe the gradients wait on disk, and reading
and rewriting them all would hold them in memory or double the disk traffic. So a pass that must *read*
them (a norm, an overflow check) streams them through host buffers read-only, and the change itself
(multiply by a coefficient, clamp) is recorded here and applied when the group next becomes resident,
just before the optimizer steps it. A read-only view (``gradient_for_reading``) applies the recorded
changes to its copy, so later passes see the same values the step will.

[Note: device-to-host copies are events]
Copies between the device and the host may run on a side stream (CUDA): every copy returns an event and
nothing reads or rewrites the copy's target (or source) before waiting on it. On a CPU device the copy is
done when it returns, which is why tests run this code under a copy engine that completes copies late on a
thread (``tests/helpers/late_copies.py``): a missing wait then shows up as wrong numbers.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from ..memory.buffers import OFFLOAD_HOST, OFFLOAD_NVME, host_buffer, return_free_heap
from .aio import write_range
from .tiers import OffloadTiers

MASTER, GRAD = "master", "grad"


@dataclass(frozen=True)
class ShardView:
    """One shard parameter of the group and the range ``[lo, hi)`` of the flat shard it covers."""

    param: nn.Parameter
    lo: int
    hi: int
    trainable: bool


_EMPTY: dict[torch.dtype, torch.Tensor] = {}


def empty_placeholder(dtype: torch.dtype) -> torch.Tensor:
    """The 0-element tensor that stands for values waiting on disk (shared: it is never written)."""
    if dtype not in _EMPTY:
        _EMPTY[dtype] = torch.empty(0, dtype=dtype)
    return _EMPTY[dtype]


def state_kind(key: str) -> str:
    return f"state-{key}"


class GroupStore:
    """One group's master, gradient and optimizer state in the offload tiers (see the module notes)."""

    def __init__(self, offload: OffloadTiers, index: int, initial: torch.Tensor, trainable: bool) -> None:
        self.offload = offload
        self.name = f"g{index}"
        self.numel, self.dtype = initial.numel(), initial.dtype
        self.nbytes = initial.numel() * initial.element_size()
        self.trainable = trainable
        self.views: list[ShardView] = []
        self.master: Optional[torch.Tensor] = self._permanent(self.numel, self.dtype)  # None while on disk
        with torch.no_grad():
            self.master.copy_(initial)
        self.grad: Optional[torch.Tensor] = None  # the gradient shard, while in memory
        self.grad_events: list = []  # (ticket, read): device -> host gradient copies in flight ("cpu" tier)
        self.late_adds: list[tuple] = []  # (staging, ticket, read): accumulated slices still on their way to the host
        self.readers: list = []  # copies that read the master (uploads to the device) and may still run
        self.files: dict = {}
        self.writes: dict[str, Future] = {}  # kind -> the last write of that file, with its buffer
        self.reads: dict[str, tuple[Future, torch.Tensor]] = {}
        self.state_dtypes: dict[str, torch.dtype] = {}  # per-element optimizer-state keys on disk
        self.grad_on_disk = False
        self.markers: dict[int, tuple[torch.Tensor, int]] = {}
        self.resident = True
        self.states: dict[str, torch.Tensor] = {}  # per-element state buffers, while resident
        self.optimizers: list[torch.optim.Optimizer] = []  # set by the engine as optimizers are sharded
        self.deferred: list[tuple[str, object, Optional[set]]] = []  # see [Note: deferred gradient operations]
        if trainable and not offload.nvme:
            self.grad = self._permanent(self.numel, self.dtype)

    def _permanent(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer that lives as long as the store (cpu tier): never pinned as a whole (copies to and
        from the device go through pinned staging, see copies.py)."""
        buffer = host_buffer(numel, dtype)
        self.offload.ledger.add(OFFLOAD_HOST, buffer.numel() * buffer.element_size())
        return buffer

    # -- set-up ------------------------------------------------------------------------------------

    def bind(self, views: list[ShardView]) -> None:
        """Called once the group's shard parameters exist (they view ``self.master``)."""
        self.views = views
        if self.offload.nvme:
            self._file(MASTER, self.dtype)
            if self.trainable:
                self._file(GRAD, self.dtype)
            self._write(MASTER, self.master, owned=False)
            self._settle(MASTER)  # the permanent buffer goes: from now on the master lives on disk
            self.offload.ledger.remove(OFFLOAD_HOST, self.nbytes)
            self.master = None
            self._evict()

    @property
    def trainable_views(self) -> list[ShardView]:
        return [v for v in self.views if v.trainable]

    def _file(self, kind: str, dtype: torch.dtype):
        nbytes = self.numel * torch.empty((), dtype=dtype).element_size()
        self.files[kind] = self.offload.swap.create(f"{self.name}-{kind}", nbytes)
        self.offload.ledger.add(OFFLOAD_NVME, nbytes)
        return self.files[kind]

    def ensure_state(self, key: str, dtype: torch.dtype) -> None:
        """A swap file for per-element optimizer state ``key`` (before a checkpoint fills it)."""
        if self.offload.nvme and key not in self.state_dtypes:
            self.state_dtypes[key] = dtype
            self._file(state_kind(key), dtype)

    def file_range(self, kind: str, lo: int, hi: int):
        """(swap file, byte offset, dtype) of elements ``[lo, hi)`` of ``kind`` (NVMe tier, for checkpoints)."""
        dtype = self.dtype if kind in (MASTER, GRAD) else self.state_dtypes[kind[len("state-") :]]
        return self.files[kind], lo * torch.empty((), dtype=dtype).element_size(), dtype

    def write_master_range(self, lo: int, hi: int, values: torch.Tensor) -> None:
        """Write elements ``[lo, hi)`` of the master straight to its swap file (the group is on disk)."""
        self._settle(MASTER)
        file, offset, dtype = self.file_range(MASTER, lo, hi)
        write_range(file, values.to(dtype).contiguous(), offset)

    # -- file transfers (NVMe tier) -----------------------------------------------------------------

    def _write(
        self, kind: str, buffer: torch.Tensor, ready: Optional[Callable] = None, owned: bool = True,
        after: Optional[Callable[[], None]] = None,
    ) -> None:
        """Write ``buffer`` to the file of ``kind``: ``ready()`` first, on the I/O thread; ``owned``: the
        buffer goes back to the host pool once written; ``after()`` then, on this thread."""
        self._settle(kind)
        self.writes[kind] = (self.offload.io.write(self.files[kind], buffer, ready=ready), owned, after)
        self.offload.writing.append(self)

    def _settle(self, kind: str) -> None:
        """Wait for the last write of ``kind`` (a read or a new write of that file must come after it)."""
        entry = self.writes.pop(kind, None)
        if entry is not None:
            future, owned, after = entry
            buffer = self.offload.io.wait(future)
            if owned:
                self.offload.host.give(buffer)
            if after is not None:
                after()

    def drain(self) -> None:
        """Wait for every write in flight and give its buffer back."""
        for kind in list(self.writes):
            self._settle(kind)

    def _read(self, kind: str, dtype: torch.dtype) -> None:
        self._settle(kind)
        buffer = self.offload.host.take(self.numel, dtype)
        self.reads[kind] = (self.offload.io.read(self.files[kind], buffer), buffer)

    def read_into(self, kind: str, target: torch.Tensor) -> Future:
        """Start reading the whole file of ``kind`` into ``target`` (a host tensor of the right size)."""
        self._settle(kind)
        return self.offload.io.read(self.files[kind], target)

    def read_file(self, kind: str) -> tuple[Future, torch.Tensor]:
        """Start reading the whole file of ``kind`` into a pooled host buffer (read-only use; give it back)."""
        self._settle(kind)
        dtype = self.dtype if kind in (MASTER, GRAD) else self.state_dtypes[kind[len("state-") :]]
        buffer = self.offload.host.take(self.numel, dtype)
        return self.offload.io.read(self.files[kind], buffer), buffer

    # -- residency (NVMe tier) ----------------------------------------------------------------------

    def start_load(self) -> None:
        """Issue the reads that make this group resident (master, gradient if one waits, state)."""
        if not self.offload.nvme or self.resident or self.reads:
            return
        self._forget_stale_gradient()
        self._read(MASTER, self.dtype)
        if self.grad_on_disk:
            self._read(GRAD, self.dtype)
        for key, dtype in self.state_dtypes.items():
            self._read(state_kind(key), dtype)

    def note_reader(self, event) -> None:
        """A copy reading the master is in flight: nothing writes (or frees) the master before it is done."""
        if event is not None:
            self.readers.append(event)

    def _wait_readers(self) -> None:
        for event in self.readers:
            self.offload.copies.wait_on_host(event)
        self.readers = []

    def attach(self) -> None:
        """Make the group resident: wait for its reads, point shard parameters, gradients and state at the
        buffers, and apply deferred gradient operations. (Host tier: wait for copies still in flight, so the
        step may write the master and read the gradient.)"""
        self.wait_grads()
        self._wait_readers()
        if not self.offload.nvme or self.resident:
            self._apply_deferred()
            return
        self.start_load()
        buffers = {kind: self.offload.io.wait(future) for kind, (future, _) in self.reads.items()}
        self.reads = {}
        self.master = buffers.pop(MASTER)
        self.grad = buffers.pop(GRAD, None)
        states = {kind[len("state-") :]: buffer for kind, buffer in buffers.items()}
        optimizer_state = self._optimizer_states()
        for view in self.views:
            p = view.param
            p.grad = None
            p.data = self.master[view.lo : view.hi]
            if self.grad is not None and view.trainable:
                p.grad = self.grad[view.lo : view.hi]
            for state in optimizer_state:
                entry = state.get(p)
                for key, buffer in states.items():
                    if entry is not None and key in entry:
                        entry[key] = buffer[view.lo : view.hi]
        self.states = states
        self.resident = True
        self._apply_deferred()

    def evict(self, write_grad: bool = False) -> None:
        """Write the resident group back (master, new or changed state; the gradient if asked) and evict it."""
        if not self.offload.nvme or not self.resident:
            return
        self._wait_readers()  # the master buffer goes back to the pool once written
        states = self.states
        created = False  # the optimizer made its state this step (on the heap): see below
        for state in self._optimizer_states():
            for view in self.views:
                entry = state.get(view.param)
                for key, value in (entry or {}).items():
                    if not _per_element(value, view):
                        continue
                    if key not in states:
                        states[key] = self.offload.host.take(self.numel, value.dtype, zero=True)
                        self.ensure_state(key, value.dtype)
                        created = True
                    target = states[key][view.lo : view.hi]
                    if value.data_ptr() != target.data_ptr():
                        target.copy_(value.reshape(-1))
        self._write(MASTER, self.master)
        for key, buffer in states.items():
            self._write(state_kind(key), buffer)
        if self.grad is not None:
            if write_grad:
                self._write(GRAD, self.grad)
            else:
                self.offload.host.give(self.grad)
        self.states = {}
        self._evict()
        if created:  # the optimizer's own state tensors (heap) were copied into our buffers and dropped
            return_free_heap()  # [Note: the heap between phases] in engine/memory/buffers.py

    def _evict(self) -> None:
        """Placeholders in place of everything now on disk (see [Note: NVMe-tier residency]); one empty
        tensor per dtype serves them all, so evicting allocates nothing."""
        for state in self._optimizer_states():
            for view in self.views:
                entry = state.get(view.param)
                for key in self.state_dtypes:
                    if entry is not None and key in entry:
                        entry[key] = empty_placeholder(self.state_dtypes[key])
        for view in self.views:
            p = view.param
            p.grad = None
            p.data = empty_placeholder(self.dtype)
            if self.grad_on_disk and view.trainable and id(p) in self.markers:
                self._set_marker(p)
        self.master = None
        self.grad = None
        self.resident = False

    def _set_marker(self, p: nn.Parameter) -> None:
        marker = torch.empty(0, dtype=self.dtype)
        p.grad = marker
        self.markers[id(p)] = (marker, marker._version)

    def _optimizer_states(self) -> list[dict]:
        return [optimizer.state for optimizer in self.optimizers]

    def close(self) -> None:
        """Everything in flight finished; the host tier's permanent buffers leave the ledger."""
        self.drain()
        self.wait_grads()
        self._wait_readers()
        for buffer in (self.master, self.grad) if not self.offload.nvme else ():
            if buffer is not None:
                self.offload.ledger.remove(OFFLOAD_HOST, buffer.numel() * buffer.element_size())

    def require_resident(self, what: str) -> torch.Tensor:
        if not self.resident:
            raise RuntimeError(
                f"zero3: {what} needs the master shard of {self.name!r} in memory; wrap the call in "
                "`engine.states_in_memory()` (offload_optimizer='nvme')."
            )
        return self.master

    # -- gradients -----------------------------------------------------------------------------------

    def _grads_fresh(self) -> bool:
        """True when the next reduced gradient replaces the stored one (``zero_grad`` ran since)."""
        for view in self.trainable_views:
            p = view.param
            marker = self.markers.get(id(p))
            if p.grad is None or marker is None or p.grad is not marker[0] or marker[0]._version != marker[1]:
                return True
        return False

    def _forget_stale_gradient(self) -> None:
        if self.grad_on_disk and self._grads_fresh():
            self.grad_on_disk = False  # zero_grad ran: the gradient on disk is stale
            self.deferred = []

    def has_gradient(self) -> bool:
        """Whether the optimizer has anything to do for this group this step."""
        if self.offload.nvme and not self.resident:
            return self.grad_on_disk and not self._grads_fresh()
        return any(v.param.grad is not None for v in self.trainable_views) or bool(self.late_adds)

    def accumulate(self, reduced: torch.Tensor, read: Callable[[], None] = lambda: None) -> None:
        """Add this rank's reduced gradient slice (on the device) into the group's gradient shard; ``read()``
        is called once the copy from ``reduced`` has completed (it may then be reused)."""
        if not self.offload.nvme:
            self._accumulate_in_host_memory(reduced, read)
        elif self.resident:  # inside states_in_memory(): plain in-memory accumulation
            self._accumulate_resident(reduced)
            read()
        else:
            self._accumulate_on_disk(reduced, read)

    def _accumulate_in_host_memory(self, reduced: torch.Tensor, read: Callable[[], None]) -> None:
        copies = self.offload.copies
        fresh = [v for v in self.trainable_views if v.hi > v.lo and v.param.grad is None]
        if len(fresh) == len([v for v in self.trainable_views if v.hi > v.lo]):
            # the first micro-batch: the slice is the gradient, copied straight into the host shard
            self._drop_late_adds()  # left by micro-batches whose step never came (zero_grad ran since)
            self.grad_events.append((copies.copy(self.grad, reduced), read))
            for view in fresh:
                view.param.grad = self.grad[view.lo : view.hi]
            return
        if fresh:  # some parameters start afresh: their part must be zero before the slice is added
            self.wait_grads()
            for view in fresh:
                self.grad[view.lo : view.hi].zero_()
                view.param.grad = self.grad[view.lo : view.hi]
        # accumulation: the slice travels to a staging buffer without blocking the host, and is added
        # when the gradient is next needed (``wait_grads``)
        staging = self.offload.host.take(self.numel, self.dtype)
        self.late_adds.append((staging, copies.copy(staging, reduced), read))

    def _accumulate_on_disk(self, reduced: torch.Tensor, read: Callable[[], None]) -> None:
        copies = self.offload.copies
        host = self.offload.host.take(self.numel, self.dtype)
        event = copies.copy(host, reduced)
        ready: Optional[Callable] = lambda: copies.wait_on_host(event)  # noqa: E731 (on the I/O thread)
        # ``reduced`` may be reused once the copy has read it: at once when the copy is already done,
        # else once the write (which waits for the copy) has finished, back on this thread
        after: Optional[Callable] = read
        if event is None:
            read()
            after = None
        if self.grad_on_disk and not self._grads_fresh():
            self._read(GRAD, self.dtype)
            future, stored = self.reads.pop(GRAD)
            self.offload.io.wait(future)
            copies.wait_on_host(event)
            if after is not None:
                read()
            host.add_(stored)
            self.offload.host.give(stored)
            ready = after = None
        self._write(GRAD, host, ready=ready, after=after)
        self.offload.throttle(self.offload.buffer_count)
        self.grad_on_disk = True
        for view in self.trainable_views:
            self._set_marker(view.param)

    def _accumulate_resident(self, reduced: torch.Tensor) -> None:
        if self.grad is None or self._grads_fresh():
            if self.grad is None:
                self.grad = self.offload.host.take(self.numel, self.dtype)
            self.grad.zero_()
            self.deferred = []
        staging = self.offload.host.take(self.numel, self.dtype)
        self.offload.copies.wait_on_host(self.offload.copies.copy(staging, reduced))
        self.grad.add_(staging)
        self.offload.host.give(staging)
        self.grad_on_disk = True
        for view in self.trainable_views:
            view.param.grad = self.grad[view.lo : view.hi]
            self.markers[id(view.param)] = (view.param.grad, view.param.grad._version)

    def wait_grads(self) -> None:
        """Block until every device -> host gradient copy has landed and pending accumulations are added
        (before anything on the host reads or rewrites the gradient shard)."""
        copies = self.offload.copies
        for event, read in self.grad_events:
            copies.wait_on_host(event)
            read()
        self.grad_events = []
        for staging, event, read in self.late_adds:
            copies.wait_on_host(event)
            read()
            self.grad.add_(staging)
            self.offload.host.give(staging)
        self.late_adds = []

    def _drop_late_adds(self) -> None:
        for staging, event, read in self.late_adds:
            self.offload.copies.wait_on_host(event)  # the copy must be done before the buffer is reused
            read()
            self.offload.host.give(staging)
        self.late_adds = []

    # -- [Note: deferred gradient operations] ----------------------------------------------------------

    def defer(self, op: str, value: object, params: Optional[set] = None) -> None:
        """Record ``op`` (``"mul"`` by a scalar tensor, ``"clamp"`` to +-value) for the gradients of the
        shard parameters in ``params`` (ids; None: all), to be applied when the gradient is in memory."""
        self.deferred.append((op, value, params))

    def _apply_deferred(self, grad: Optional[torch.Tensor] = None) -> None:
        target = self.grad if grad is None else grad
        if target is not None:
            for op, value, params in self.deferred:
                for view in self.trainable_views:
                    if params is None or id(view.param) in params:
                        _apply(op, value, target[view.lo : view.hi])
        if grad is None:
            self.deferred = []

    def gradient_for_reading(self) -> Optional[tuple[Future, torch.Tensor, Callable[[], torch.Tensor]]]:
        """Start reading the gradient shard for a read-only pass (NVMe, not resident): ``(future, buffer,
        finish)``; ``finish()`` waits and returns the gradient with the deferred operations applied to
        this copy. None when no gradient waits. Give the buffer back with ``offload.host.give``."""
        self._forget_stale_gradient()
        if not self.grad_on_disk:
            return None
        future, buffer = self.read_file(GRAD)

        def finish() -> torch.Tensor:
            self.offload.io.wait(future)
            self._apply_deferred(buffer)
            return buffer

        return future, buffer, finish


def _apply(op: str, value: object, grad: torch.Tensor) -> None:
    if op == "mul":
        grad.mul_(value.to(grad.device, grad.dtype))  # type: ignore[union-attr]
    elif op == "clamp":
        grad.clamp_(-value, value)  # type: ignore[operator]
    else:
        raise ValueError(f"unknown deferred gradient operation {op!r}")


def _per_element(value, view: ShardView) -> bool:
    return torch.is_tensor(value) and value.dim() > 0 and value.numel() == view.hi - view.lo and value.numel() > 0
