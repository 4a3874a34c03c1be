"""How long a collective took: the host's clock on gloo / CPU, device events on CUDA.

A ``Span`` holds one collective's time marks. The ``Communicator`` asks its clock for a span just
before it issues a collective, tells the span when the collective was issued (``issued``) and when the
caller's wait began and ended (``waiting`` / ``waited``), then keeps the span until its marks can be
read (``ready``) and adds them to its totals: ``seconds`` (issue to completion) and ``exposed`` (how
long the compute side waited).

[Note: completion time]
A collective runs from issue to *completion*; the part of that the compute side spent waiting for it is
its *exposed* time (the rest overlapped with compute). Who can see completion differs by backend:

- Host (gloo; and the one-rank copies on the CPU). The issue is stamped on the host's clock. gloo runs
  a collective on its own thread; where the work object offers a future (gloo's all-gather and
  all-reduce do), a done-callback stamps the moment it completed, so a collective that finished long
  before the caller waited is not charged the compute in between. Without a future (gloo's
  reduce-scatter) completion is the end of the caller's wait, an upper bound. The host blocks in
  ``wait()``, so exposed = the host time spent in it.
- Device (NCCL on CUDA). The host neither blocks in ``wait()`` (it only makes the compute stream wait)
  nor learns when the collective ends (NCCL's future completes at enqueue), so host stamps would measure
  launch latency. Events are recorded instead: ``start`` on the issuing stream just before the issue
  (NCCL's stream waits for that point before it starts); ``end`` on a timing stream of the clock's own,
  made to wait on the collective through its work's future and then recorded: nothing else runs there,
  so ``end`` completes when the collective does. (The future's ``wait()`` is a stream wait that leaves
  the work's tensors alone; ``Work.wait()`` there could release tensors the compute stream still needs,
  under ``TORCH_NCCL_AVOID_RECORD_STREAMS``.) Exposed time is the compute stream's own stall: events
  just before and after its stream wait; the second completes only when both the stream reached the
  wait and the collective ended.
  Events are read lazily. The communicator keeps spans in issue order and adds them to its totals when
  its totals are read (a monitor at log time: one sync there, never one per collective); on the hot
  path it only drains spans whose events have already completed (``query()``, no sync), which bounds
  how many it holds.

Both clocks measure issue to completion: a collective queued behind an earlier one on the same group is
charged its time in the queue. A finisher the caller runs after the wait (the copy out of an all-reduce
that stands in for a reduce-scatter) is local work and counts in neither figure.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Union

import torch


class HostSpan:
    """One collective's marks on the host's clock (gloo / CPU)."""

    def __init__(self) -> None:
        self._issued = time.perf_counter()
        self._completed: Optional[float] = None  # stamped on the backend's thread
        self._wait_start: Optional[float] = None
        self._wait_end: Optional[float] = None

    def issued(self, work: Any) -> None:
        if work is None:  # one rank: the copy ran inside the call, before the wait
            self._completed = time.perf_counter()
            return
        try:
            work.get_future().add_done_callback(self._stamp)
        except RuntimeError:  # this backend / op has no future: completion is the end of the wait
            pass

    def _stamp(self, _future: Any) -> None:
        self._completed = time.perf_counter()

    def waiting(self) -> None:
        self._wait_start = time.perf_counter()

    def waited(self) -> None:
        self._wait_end = time.perf_counter()

    def ready(self) -> bool:
        return self._wait_end is not None

    def settle(self) -> None:
        if not self.ready():
            raise RuntimeError("zero3 internal error: a collective's time was read before its wait() ended.")

    def seconds(self) -> float:
        assert self._wait_end is not None
        completed = self._wait_end if self._completed is None else min(self._completed, self._wait_end)
        return completed - self._issued

    def exposed(self) -> float:
        """From the wait to the completion: the caller's wake-up after it is the scheduler's, not the
        collective's (on a loaded machine it made exposed exceed issue-to-completion)."""
        assert self._wait_start is not None and self._wait_end is not None
        completed = self._wait_end if self._completed is None else min(self._completed, self._wait_end)
        return max(0.0, completed - self._wait_start)


class HostClock:
    """The host's clock: for gloo, and for the CPU."""

    def span(self) -> HostSpan:
        return HostSpan()

    def synchronize(self) -> None:
        """Nothing to wait for: on the host a collective is over when its wait returns."""


class EventSpan:
    """One collective's marks as device events (CUDA, or any device whose torch module has events and streams)."""

    def __init__(self, clock: "EventClock") -> None:
        self._clock = clock
        self._start = clock.record()
        self._end: Any = None
        self._wait_start: Any = None
        self._wait_end: Any = None

    def issued(self, work: Any) -> None:
        if work is None:  # one rank: the copy was enqueued on this stream, after ``start``
            self._end = self._clock.record()
            return
        try:
            future = work.get_future()
        except RuntimeError:  # no future: ``end`` falls back to the end of the wait (an upper bound)
            return
        with self._clock.on_timing_stream():
            future.wait()  # the timing stream waits for the collective; the host does not
            self._end = self._clock.record()

    def waiting(self) -> None:
        self._wait_start = self._clock.record()

    def waited(self) -> None:
        self._wait_end = self._clock.record()
        if self._end is None:
            self._end = self._wait_end

    def _events(self) -> tuple:
        return (self._start, self._end, self._wait_start, self._wait_end)

    def ready(self) -> bool:
        return self._wait_end is not None and all(event.query() for event in self._events())

    def settle(self) -> None:
        if self._wait_end is None:
            raise RuntimeError("zero3 internal error: a collective's time was read before its wait() ended.")
        for event in self._events():
            event.synchronize()

    def seconds(self) -> float:
        return self._start.elapsed_time(self._end) / 1e3  # events measure milliseconds

    def exposed(self) -> float:
        return self._wait_start.elapsed_time(self._wait_end) / 1e3


class EventClock:
    """Device events on ``device``'s streams, through its torch module (``torch.cuda`` for CUDA).

    ``device_module`` stands in for that module (tests pass a fake with the same names: ``Event``,
    ``Stream``, ``stream``, ``current_stream``, ``synchronize``)."""

    def __init__(self, device: torch.device, device_module: Any = None) -> None:
        self.device = device
        self._module = device_module if device_module is not None else torch.get_device_module(device)
        self._timing_stream: Any = None

    def span(self) -> EventSpan:
        return EventSpan(self)

    def record(self) -> Any:
        """A timing event recorded now on the current stream."""
        event = self._module.Event(enable_timing=True)
        event.record(self._module.current_stream(self.device))
        return event

    @contextmanager
    def on_timing_stream(self) -> Iterator[None]:
        if self._timing_stream is None:
            self._timing_stream = self._module.Stream(device=self.device)
        with self._module.stream(self._timing_stream):
            yield

    def synchronize(self) -> None:
        self._module.synchronize(self.device)


Clock = Union[HostClock, EventClock]
Span = Union[HostSpan, EventSpan]


def clock_for(device: torch.device) -> Clock:
    """Events where the group's collectives run on a device (NCCL on CUDA), the host's clock otherwise."""
    return HostClock() if device.type == "cpu" else EventClock(device)
