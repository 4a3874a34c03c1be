"""Deciding, from what every rank publishes, that the collective this rank waits in can never complete.

[Note: finding collectives that cannot complete]
A collective pairs the n-th call of every rank on one process group. When ranks issue different ones
(``trainer.save_checkpoint`` under ``if rank == 0``: rank 0 waits in the save's first collective, the
others in the next step's), every rank waits for ever: gloo's timeout is 30 minutes, and Python signal
handlers do not run meanwhile. Each rank's watchdog thread publishes its ``CollectiveLog`` record
(comm/collective_log.py) in its heartbeat, and reads its peers' (watchdog.py). From those records:

- rank r *waits for* rank x when r is blocked in the ``s``-th collective on group g and x, a member of
  g, has issued fewer than ``s`` there (x has not reached it yet). A member that has issued it will
  complete it: the wait is slow, not mismatched, however long (a 10-minute gather of a huge unit on a
  slow network raises no alarm). Two ranks blocked in the same ``(g, s)`` with different ops (a broadcast
  against an all-reduce) are mismatched too;
- a rank is *stuck* when it has been blocked in the same collective for ``timeout`` (seen by this
  thread's clock: no cross-host clock is compared);
- this rank's wait can never complete when, following *waits for* from it through stuck ranks, it
  reaches a rank already on the path (a cycle: each waits for the next, none can move) or a rank that
  has issued nothing and changed nothing for ``idle_timeout`` while it is not in a phase this rank is
  in too (it runs code the others do not: a loop, a long rank-0-only computation);
- the verdict must hold at two polls in a row, then this rank publishes one message naming what every
  rank was doing and what to do, and every rank ends (watchdog.py).

A rank that is computing (not blocked) is never judged by ``timeout``: compile, a slow data loader or a
slow disk on one rank make the others wait, and are not mismatches. A rank inside a phase that this
rank is in too (both in ``Trainer.save_checkpoint``, rank 0 writing the files the others wait for) is
doing the same work, however long it takes.

[Note: who reads whose record]
With up to ``POLL_ALL`` ranks every watchdog reads every peer's heartbeat each poll (the liveness check
already did, so the records cost no extra key). Above that a watchdog reads rank 0 and its two
neighbours for liveness (a dead rank is seen by its neighbours, whose abort reaches everyone through one
key), and reads every rank's record only while it has itself been stuck past ``timeout``: W reads per
poll on a stuck rank, none while the job runs. (Reading W^2 keys per poll across a job of thousands of
ranks would load the store that every rank's rendezvous depends on.)
"""

from __future__ import annotations

import json
from typing import Any, Optional

from ..comm.collective_log import GENERIC_FIX

POLL_ALL = 8  # [Note: who reads whose record]
HANG = "the ranks wait in different collectives, which can never complete"  # how the message begins

Record = dict[str, Any]


def encode(beat: int, record: Record) -> str:
    """A heartbeat value: the beat counter, then the record (JSON)."""
    return f"{beat} {json.dumps(record, separators=(',', ':'))}"


def decode(value: bytes) -> Optional[tuple[str, Record]]:
    """(the record's text, the record) of a heartbeat value; None for a bare counter (starting up)."""
    text = value.decode(errors="replace")
    _, _, body = text.partition(" ")
    if not body:
        return None
    try:
        return body, json.loads(body)
    except ValueError:
        return None


class HangCheck:
    """One rank's judgement over the records it reads (see the module note)."""

    def __init__(self, rank: int, world_size: int, timeout: float, idle_timeout: Optional[float]) -> None:
        self.rank, self.world_size = rank, world_size
        self.timeout, self.idle_timeout = timeout, idle_timeout
        self._blocked_since: dict[int, tuple[Any, float]] = {}  # rank -> (blocked key, first seen)
        self._changed: dict[int, tuple[str, float]] = {}  # rank -> (record text, first seen)
        self._suspect = 0  # polls in a row that found this rank's wait hopeless

    def observe(self, texts: dict[int, str], records: dict[int, Record], now: float) -> None:
        """Note when each rank's record, and its blocked collective, last changed."""
        for rank, record in records.items():
            blocked = record.get("blocked")
            key = tuple(blocked[:3]) if blocked else None
            if self._blocked_since.get(rank, (object(),))[0] != key:
                self._blocked_since[rank] = (key, now)
            text = texts.get(rank, "")
            if self._changed.get(rank, ("\0",))[0] != text:
                self._changed[rank] = (text, now)

    def stuck_for(self, rank: int, now: float) -> float:
        key, since = self._blocked_since.get(rank, (None, now))
        return now - since if key is not None else 0.0

    def idle_for(self, rank: int, now: float) -> float:
        return now - self._changed.get(rank, ("", now))[1]

    def verdict(self, records: dict[int, Record], now: float) -> Optional[str]:
        """The message that ends every rank, once this rank's wait is found hopeless at two polls in a row."""
        found = self._hopeless(records, now)
        if found is None:
            self._suspect = 0
            return None
        self._suspect += 1
        return describe(records, found, self, now) if self._suspect >= 2 else None

    def _hopeless(self, records: dict[int, Record], now: float) -> Optional[list[int]]:
        """The ranks on a chain of waits that cannot end (this rank first), or None."""
        mine = records.get(self.rank, {}).get("blocked")
        if not mine or self.stuck_for(self.rank, now) < self.timeout:
            return None
        for rank, record in records.items():  # same collective, different op
            other = record.get("blocked")
            if rank != self.rank and other and other[:2] == mine[:2] and other[2] != mine[2]:
                if self.stuck_for(rank, now) >= self.timeout:
                    return [self.rank, rank]
        path: list[int] = [self.rank]

        def walk(rank: int) -> bool:
            for other in self._waits_for(rank, records):
                if other in path:
                    path.append(other)
                    return True
                blocked = records[other].get("blocked")
                if blocked and self.stuck_for(other, now) >= self.timeout:
                    path.append(other)
                    if walk(other):
                        return True
                    path.pop()
                elif not blocked and self._idle(other, records, now):
                    path.append(other)
                    return True
            return False

        return path if walk(self.rank) else None

    def _waits_for(self, rank: int, records: dict[int, Record]) -> list[int]:
        group, seq, _, _, members = records[rank]["blocked"]
        members = members if members is not None else range(self.world_size)
        return [m for m in members if m != rank and m in records and records[m]["issued"].get(group, 0) < seq]

    def _idle(self, rank: int, records: dict[int, Record], now: float) -> bool:
        if self.idle_timeout is None or self.idle_for(rank, now) < self.idle_timeout:
            return False
        theirs = records[rank].get("phases") or []
        mine = records[self.rank].get("phases") or []
        return not (theirs and theirs[-1] in mine)  # in a phase this rank is in too: the same work


def describe_rank(rank: int, record: Record, check: HangCheck, now: float) -> str:
    phases = " > ".join(record.get("phases") or []) or "outside any step"
    blocked = record.get("blocked")
    if blocked:
        group, seq, op, detail, _ = blocked
        what = f"{op} {detail}".strip() if detail else op
        return f"rank {rank}: {phases}, waiting {check.stuck_for(rank, now):.0f} s in {what} (#{seq} on the {group} group)"
    return f"rank {rank}: {phases}, in no collective and unchanged for {check.idle_for(rank, now):.0f} s"


def describe(records: dict[int, Record], chain: list[int], check: HangCheck, now: float) -> str:
    """One line: what every rank (every rank read; at least those on the chain) was doing, and the fix."""
    ranks = sorted(records) if len(records) <= POLL_ALL else sorted(set(chain) | {0})
    lines = "; ".join(describe_rank(rank, records[rank], check, now) for rank in ranks if rank in records)
    fixes = [fix for rank in [*chain, *ranks] for fix in reversed(records.get(rank, {}).get("fixes") or [])]
    fix = fixes[0] if fixes else GENERIC_FIX
    return (
        f"{HANG} (found by rank {check.rank}): "
        f"{lines}. To fix: {fix}"
    )
