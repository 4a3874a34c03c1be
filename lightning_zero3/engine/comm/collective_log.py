"""What this rank is doing, kept cheaply by the main thread for the watchdog to publish (see
[Note: finding collectives that cannot complete] in engine/failure/hang_check.py).

Three things, all in memory, none touching the store (the watchdog thread reads and publishes them):

- ``issued``: per group name (``"job"``, ``"reduce"``, ``"check"``, ``"secondary"``, ``"world"`` for
  Lightning's own barrier / broadcast / reduce), how many collectives this rank has issued on it. Ranks
  that run the same program count alike, whatever torch itself issues in between;
- ``blocked``: a stack of the collectives the main thread waits in, innermost last. An entry is
  ``(group, sequence number on that group, op, detail, members)``; ``members`` None is every rank.
  A region whose collectives zero3 does not issue itself (a ``torch.distributed.checkpoint`` write, an
  object all-gather inside torch) is one entry for the whole region (``collective``);
- ``phases``: a stack of ``(label, fix)``: what the rank is doing in words ("training step 3",
  "Trainer.save_checkpoint"), and for some, what to do when ranks disagree there.

Each update is a dict increment or a list append / pop on the main thread: no lock, no store round
trip, no string formatting on the hot path (``detail`` is formatted by the watchdog thread, which copies
the containers before reading them: a ``dict()`` or ``list()`` copy is atomic under the GIL).
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, TypeVar

Entry = tuple  # (group, sequence, op, detail, members)

F = TypeVar("F", bound=Callable[..., Any])


class CollectiveLog:
    """The collectives and phases of this process's main thread (one per process: ``LOG``)."""

    def __init__(self) -> None:
        self.issued: dict[str, int] = {}
        self.blocked: list[Entry] = []
        self.phases: list[tuple[str, Optional[str]]] = []

    def issue(self, group: str, op: str, detail: Any = None, members: Optional[list[int]] = None) -> Entry:
        """A collective of kind ``op`` is issued on ``group``: its entry (give it to ``wait_begin``)."""
        seq = self.issued[group] = self.issued.get(group, 0) + 1
        return (group, seq, op, detail, members)

    def wait_begin(self, entry: Entry) -> None:
        self.blocked.append(entry)

    def wait_end(self) -> None:
        if self.blocked:
            self.blocked.pop()

    def snapshot(self) -> dict[str, Any]:
        """A copy that the watchdog thread may read at leisure (JSON-ready)."""
        issued, blocked, phases = dict(self.issued), list(self.blocked), list(self.phases)
        waiting = None
        if blocked:
            group, seq, op, detail, members = blocked[-1]
            waiting = [group, seq, op, describe_detail(detail), members]
        return {"issued": issued, "blocked": waiting, "phases": [p[0] for p in phases],
                "fixes": [p[1] for p in phases if p[1]]}  # fmt: skip

    def reset(self) -> None:
        self.issued.clear()
        self.blocked.clear()
        self.phases.clear()


LOG = CollectiveLog()


def describe_detail(detail: Any) -> str:
    """Words for an entry's ``detail``: an element count, units (objects with a ``name``), or text."""
    if detail is None:
        return ""
    if isinstance(detail, int):
        return f"{detail:,} elements"
    if isinstance(detail, (list, tuple)):
        names = [getattr(item, "name", str(item)) for item in detail[:3]]
        more = f" and {len(detail) - 3} more" if len(detail) > 3 else ""
        return "unit " + ", ".join(repr(n) for n in names) + more
    return str(detail)


@contextmanager
def phase(label: str, fix: Optional[str] = None) -> Iterator[None]:
    """This rank is doing ``label`` (words a user recognises); ``fix``: what to do when ranks wait on
    different collectives while one of them is here."""
    LOG.phases.append((label, fix))
    try:
        yield
    finally:
        LOG.phases.pop()


def in_phase(label: str, fix: Optional[str] = None) -> Callable[[F], F]:
    """``phase`` around every call of the decorated function."""

    def decorate(function: F) -> F:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with phase(label, fix):
                return function(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


@contextmanager
def collective(group: str, op: str, detail: Any = None) -> Iterator[None]:
    """The main thread runs a collective (or a region of collectives) that zero3 does not issue itself:
    counted as one on ``group``, and shown as waited in until it returns."""
    LOG.blocked.append(LOG.issue(group, op, detail))
    try:
        yield
    finally:
        LOG.wait_end()


# What to do, by where a rank was when ranks disagreed (the ``fix`` of a ``phase``).
SAVE_FIX = (
    "call `trainer.save_checkpoint` on every rank: under zero3 it is a collective (every rank writes its "
    "own shards), so do not guard it with `if trainer.global_rank == 0` / `trainer.is_global_zero` "
    "(ModelCheckpoint already calls it on every rank)"
)
FABRIC_SAVE_FIX = (
    "call `fabric.save` (and `fabric.load`) on every rank, with the same state: under zero3 it is a "
    "collective (every rank writes its own shards), so do not guard it with `if fabric.global_rank == 0`"
)
EXPORT_FIX = (
    "call `save_full_weights` on every rank: it gathers every unit from all ranks (rank 0 writes the "
    "file), so do not guard it with `if rank == 0`"
)
LOAD_FIX = "load the checkpoint on every rank (a collective under zero3)"
GENERIC_FIX = (
    "every rank must issue the same collectives in the same order: code that runs on some ranks only "
    "(under `if rank == 0:`) must not save checkpoints, export weights, log with `sync_dist=True`, call "
    "barriers or run the model, and every rank must run each step's forward and backward"
)
