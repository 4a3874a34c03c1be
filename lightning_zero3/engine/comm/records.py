"""What an issued collective leaves behind: its totals (``CollectiveStats``), the handle that completes
it (``Pending``, ``Agreement``), and the works of a point-to-point batch waited on as one.

The ``Communicator`` (``communicator.py``) makes them; ``comm`` below is that communicator, whose
``_record`` and ``_stats`` they feed (see [Note: completion time] in ``timing.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from .collective_log import LOG, Entry
from .timing import Span


@dataclass
class CollectiveStats:
    """Totals for one collective kind since the engine started."""

    count: int = 0
    bytes: int = 0
    seconds: float = 0.0  # issue to completion
    exposed_seconds: float = 0.0  # time the compute side waited for it
    inter_node_bytes: int = 0  # received from ranks on other nodes, see [Note: inter-node bytes] in topology.py

    def add(self, nbytes: int, seconds: float, exposed: float, inter_node: int = 0) -> None:
        self.count += 1
        self.bytes += nbytes
        self.seconds += seconds
        self.exposed_seconds += exposed
        self.inter_node_bytes += inter_node


class Pending:
    """An issued collective. ``wait()`` completes it (once), then runs its finisher; its time goes to the
    communicator's totals once it can be read (see [Note: completion time] in ``timing.py``)."""

    def __init__(
        self,
        comm: Any,
        work: Any,
        span: Span,
        stats: list[CollectiveStats],
        nbytes: int,
        finish: Optional[Callable[[], None]],
        inter_node: int = 0,
        entry: Optional[Entry] = None,  # what the watchdog shows while this is waited for (collective_log.py)
    ) -> None:
        self._comm = comm
        self._entry = entry
        self._work = work
        self._span = span
        self._stats = stats
        self._nbytes = nbytes
        self._inter_node = inter_node
        self._finish = finish
        self.done = False
        span.issued(work)

    def ready(self) -> bool:
        """Whether ``wait()`` would return without blocking (the collective has completed)."""
        return self.done or self._work is None or self._work.is_completed()

    def wait(self) -> None:
        if self.done:
            return
        self._span.waiting()
        if self._work is not None:
            LOG.wait_begin(self._entry)
            try:
                self._work.wait()
            finally:
                LOG.wait_end()
        self._span.waited()
        if self._finish is not None:
            self._finish()
        self._comm._record(self._span, self._stats, self._nbytes, self._inter_node)
        self.done = True


class Agreement:
    """Every rank's tag of an ``agree_later``, once it has arrived (``rows``)."""

    def __init__(
        self, comm: Any, work: Any, everyone: Any, before: Optional[str], entry: Optional[Entry] = None
    ) -> None:
        self._comm, self._work, self._everyone, self._before = comm, work, everyone, before
        self._entry = entry
        self._rows: Optional[list[list[int]]] = everyone if work is None else None

    def rows(self) -> list[list[int]]:
        if self._rows is None:
            start = time.perf_counter()
            LOG.wait_begin(self._entry)
            try:
                self._work.wait()
            finally:
                LOG.wait_end()
            self._rows = self._everyone.tolist()
            if self._before is not None:  # straight into the totals: ``stats`` would drain (a CUDA sync)
                totals = self._comm._stats[self._before]
                elapsed = time.perf_counter() - start
                totals.seconds += elapsed
                totals.exposed_seconds += elapsed
        return self._rows


class Works:
    """The works of a batch of point-to-point operations, waited for as one collective's."""

    def __init__(self, works: list) -> None:
        self._works = works

    def wait(self) -> None:
        for work in self._works:
            work.wait()

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)

    def get_future(self) -> Any:
        return self._works[-1].get_future()  # the receive: once it is done, the data is here
