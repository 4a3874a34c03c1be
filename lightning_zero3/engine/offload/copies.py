"""Copies between the training device and host memory, asynchronous where the device allows it.

On CUDA, copies run on a side stream, so a gradient shard streams to the host while backward computes
and a parameter shard streams to the device while earlier units compute. Host buffers of the offload
tiers are ordinary (pageable) memory; an asynchronous copy needs page-locked memory, so each copy goes
through a pinned *staging* buffer from a small pool (``offload_pin_memory``): device -> staging on the
side stream, then staging -> target on the host once the copy is waited for; or source -> staging on
the host, then staging -> device on the side stream. Only the buffers of copies in flight are pinned,
never the whole rank's shards.

Each copy returns a ticket (``None`` when it is already complete). The consumer waits on it only when it
needs the data: ``wait_on_host`` before the host reads (or rewrites, or frees) what the copy touches,
``wait_on_device`` before a kernel or a collective on the compute stream reads what was copied to the
device. On a CPU device the copy is a plain synchronous copy and the ticket is ``None``; tests swap in a
copy engine that completes copies late on a thread, so that a missing wait shows up (see
[Note: device-to-host copies are events] in store.py).

[Note: side-stream lifetimes]
A tensor used on the side stream may be freed by the compute stream's caching allocator as soon as
Python drops it; ``record_stream`` tells the allocator to wait for the side stream's work first.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..memory.buffers import OFFLOAD_HOST, BufferPool, ByteLedger


class Ticket:
    """A copy in flight on the side stream (CUDA): an event, and what to do on the host once it is done."""

    def __init__(self, event: "torch.cuda.Event", then: Optional[Callable[[], None]] = None) -> None:
        self.event, self._then, self.done = event, then, False

    def wait_host(self) -> None:
        if not self.done:
            self.event.synchronize()
            if self._then is not None:
                self._then()
            self.done = True

    def wait_device(self, device: torch.device) -> None:
        torch.cuda.current_stream(device).wait_event(self.event)


class DeviceHostCopies:
    def __init__(self, device: torch.device, pin_memory: bool, ledger: ByteLedger) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.pin = pin_memory and self.cuda
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.staging = BufferPool(ledger, OFFLOAD_HOST, pin=True) if self.pin else None

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Optional[Ticket]:
        """``dst.copy_(src)`` across device and host; returns a ticket to wait on (None: already done)."""
        if not self.cuda or dst.device.type == src.device.type:
            with torch.no_grad():
                dst.copy_(src)
            return None
        if self.staging is None:  # pageable host memory: the driver copies synchronously
            with torch.no_grad():
                dst.copy_(src)
            return None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        staging = self.staging.take(src.numel(), src.dtype)
        then: Optional[Callable[[], None]]
        with torch.cuda.stream(self.stream), torch.no_grad():
            if src.is_cuda:  # device -> staging now; staging -> dst on the host once waited for
                staging.copy_(src, non_blocking=True)
                src.record_stream(self.stream)  # [Note: side-stream lifetimes]

                def then() -> None:
                    dst.copy_(staging)
                    self.staging.give(staging)

            else:  # src -> staging on the host now; staging -> device on the side stream
                staging.copy_(src)
                dst.copy_(staging, non_blocking=True)
                dst.record_stream(self.stream)
                then = lambda: self.staging.give(staging)  # noqa: E731
        event = torch.cuda.Event()
        event.record(self.stream)
        return Ticket(event, then)

    @staticmethod
    def wait_on_host(ticket: Optional[Ticket]) -> None:
        """Block the host until the copy is done (before the host reads, rewrites or frees its buffers)."""
        if ticket is not None:
            ticket.wait_host()

    def wait_on_device(self, ticket: Optional[Ticket]) -> None:
        """Make the compute stream wait for the copy (before a kernel or collective reads the result)."""
        if ticket is not None:
            ticket.wait_device(self.device)
