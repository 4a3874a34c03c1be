"""Copies between the training device and host memory, asynchronous where the device allows it.

On CUDA, copies run on a side stream from page-locked (pinned) host buffers, so a gradient shard
streams to the host while backward computes and a parameter shard streams to the device while
earlier units compute; each copy returns an event, and the consumer waits on that event only when it
needs the data (the host optimizer before stepping, the all-gather before sending). On a CPU device the
"device" and the host are the same memory: the copy is a plain (synchronous) copy between two
separate buffers, and the same code path runs.

[Note: side-stream lifetimes]
A tensor used on the side stream may be freed by the compute stream's caching allocator as soon as
Python drops it; ``record_stream`` tells the allocator to wait for the side stream's work first.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..memory import host_buffer


class DeviceHostCopies:
    def __init__(self, device: torch.device, pin_memory: bool) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.pin = pin_memory and self.cuda
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return host_buffer(numel, dtype, pin=self.pin)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Optional["torch.cuda.Event"]:
        """``dst.copy_(src)`` across device and host; returns an event to wait on (None: already done)."""
        if not self.cuda:
            with torch.no_grad():
                dst.copy_(src)
            return None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream), torch.no_grad():
            dst.copy_(src, non_blocking=True)
        for t in (dst, src):
            if t.is_cuda:
                t.record_stream(self.stream)  # [Note: side-stream lifetimes]
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    @staticmethod
    def wait_on_host(event: Optional["torch.cuda.Event"]) -> None:
        """Block the host until the copy is done (before the host reads what was copied to it)."""
        if event is not None:
            event.synchronize()

    def wait_on_device(self, event: Optional["torch.cuda.Event"]) -> None:
        """Make the compute stream wait for the copy (before a kernel or collective reads the result)."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
