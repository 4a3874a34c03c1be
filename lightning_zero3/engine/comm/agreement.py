"""Checks that every rank is about to run the same collective, so disagreement fails on every rank at once.

[Note: every all-gather is checked]
An all-gather pairs the n-th gather of every rank. If ranks run different units (a module that runs on
one rank and not on another, an expert that is its own unit), rank 0's gather of one unit would pair
with rank 1's gather of another: equal-sized units then mix silently, different sizes abort the process
inside gloo ("Received data size doesn't match expected size") or hang under NCCL. So before issuing
an all-gather, each rank all-gathers a tag of a few integers (``OrderCheck.tag``: step, pass, phase,
sequence number, elements, and the units gathered) on the check group (see [Note: three process groups]
in communicator.py) and compares the rows: every rank sees the same rows, so on a mismatch every rank raises the
same ``ExecutionOrderError``, naming what each rank was about to gather, before any gather is issued.
The rows must be read before the gather is issued, because a mismatched gather could abort the process
before a check behind it is read (gloo checks message sizes on its own thread: ``gloo::EnforceNotMet``,
SIGABRT). A gather needed at once waits for the rows (one round trip of 80 bytes, and the wait for the
other ranks to reach the same point); a gather ahead of need is agreed on a unit earlier (next note).

[Note: checks run a unit ahead]
Blocking at every unit start makes a rank that runs ahead wait there for the slowest one, even when the
gathers it issues would not have made it wait (prefetch hides them). So a gather ahead of need (prefetch) is agreed on
one unit before it is issued: the window chooses it at one unit start, its tag goes out without waiting
(``check_ahead``; the group's ``pending`` is then a ``CheckedAhead``), and at the next unit start, or as
soon as anything waits for it, ``settle`` reads the rows, compares them and issues the gather. By then
the other ranks have long sent their tags. Safety is kept by order: every rank agrees on and issues its
gathers in the same first-in first-out order, each one only after the rows said that every rank's tag
for it is the same, and only at fixed points of the program (unit starts, waits), never "when the check
happens to be done", so the ranks' collectives still pair one to one. A gather that is needed at once
(the unit starting had no prefetch, the first step, a new order) is still checked blocking, after
everything agreed on ahead has been issued.

Reduce-scatters need no tag: their order is derived on every rank from the recorded backward trace
(``grads.ReductionQueue``), and ``check_traces`` compares the traces across ranks at the end of every
backward (a digest in one more tag: ranks that skipped different units without any gather going wrong,
since the units were prefetched alike, fail there with the units named). With both in place no step
needs a collective of its own to agree on each unit as it starts: a disagreement surfaces at the next
gather or the end of that backward, before it can do harm.
"""

from __future__ import annotations

import zlib
from collections import deque
from typing import Any, Callable, Optional, Protocol, Sequence

import torch

from .communicator import Communicator
from .records import Agreement


class Checked(Protocol):
    """What the order check reads and sets of a unit's flat group (``shard/flat_group.FlatGroup``; named
    here so that this file imports nothing above it)."""

    name: str
    full: torch.Tensor
    pending: Optional[Any]  # a ``CheckedAhead`` between its check and its gather

PHASES = ("outside", "forward", "backward", "trace check")
TAG_LENGTH = 10  # every tag, so that any two tags can be compared (see ``agree``)
NAMED_UNITS = 3  # units named in a tag; more (a long coalesced gather) are folded into a hash

REMEDY = (
    "Every rank must run the same units in the same order. If a module runs on some ranks only (a routed "
    "expert, a layer skipped by a per-rank draw), choose `unit_modules` so that it sits inside a unit (for "
    "example the whole mixture-of-experts layer, not each expert), or draw the skip from a seed shared by "
    "all ranks. If the model generates a different number of tokens on each rank, keep every rank calling "
    "the model until all are done (Hugging Face: `generate(..., synced_gpus=True)`)."
)


class ExecutionOrderError(RuntimeError):
    """Ranks are about to run different units (or run them in different orders)."""


class OrderCheck:
    """Where this rank is (step, pass, phase, gathers so far) and the tags that say so."""

    def __init__(self, groups: Sequence[Checked], comm: Communicator) -> None:
        self.comm = comm
        self.index = {id(group): i for i, group in enumerate(groups)}
        self.names = [group.name for group in groups]
        self.step = 0  # backward passes finished
        self.passes = 0  # forward passes of the root module started
        self.phase = 0  # index into PHASES
        self.seq = 0  # checked gathers since the phase began
        self.ahead: deque[CheckedAhead] = deque()  # gathers agreed on ahead, not issued yet (oldest first)
        self.counts = {"blocking": 0, "ahead": 0}  # checks of each kind so far (for tests and monitors)

    def enter(self, phase: str) -> None:
        """A new forward pass, a backward pass, or back outside both."""
        self.phase = PHASES.index(phase)
        self.seq = 0
        if phase == "forward":
            self.passes += 1

    def end_backward(self) -> None:
        self.step += 1
        self.enter("outside")

    def tag(self, groups: Sequence[Checked]) -> list[int]:
        ids = [self.index[id(g)] for g in groups]
        named = (ids + [-1] * NAMED_UNITS)[:NAMED_UNITS]
        rest = zlib.crc32(repr(ids[NAMED_UNITS:]).encode()) if len(ids) > NAMED_UNITS else 0
        numel = sum(g.full.numel() for g in groups)
        tag = [self.step, self.passes, self.phase, self.seq, numel, len(ids), *named, rest]
        assert len(tag) == TAG_LENGTH
        return tag

    @property
    def checks_ahead(self) -> bool:
        """Whether gathers ahead are agreed on a unit before they are issued (several ranks)."""
        return self.comm.distributed

    def check(self, groups: Sequence[Checked]) -> None:
        """Agree with every rank on the all-gather of ``groups`` about to be issued (a collective), after
        issuing everything agreed on ahead."""
        if not self.comm.distributed or not groups:
            return
        self.settle()
        agreement = self.comm.agree_later(self.tag(groups), before="all_gather", what=groups)
        self.seq += 1
        self.counts["blocking"] += 1
        self._compare(agreement.rows())

    def check_ahead(self, groups: Sequence[Checked], issue: Callable[[list], None]) -> None:
        """Send the tag of gathers ahead of need without waiting; ``issue(groups)`` runs at the next
        ``settle`` once every rank is seen to agree (see [Note: checks run a unit ahead])."""
        agreement = self.comm.agree_later(self.tag(groups), before="all_gather", what=groups)
        entry = CheckedAhead(self, agreement, list(groups), issue)
        self.seq += 1
        self.counts["ahead"] += 1
        for group in groups:
            group.pending = entry
        self.ahead.append(entry)

    def settle(self) -> None:
        """Issue every gather agreed on ahead, in the order they were checked (raises on disagreement)."""
        while self.ahead:
            entry = self.ahead.popleft()
            for group in entry.groups:
                group.pending = None
            try:
                self._compare(entry.agreement.rows())
            except ExecutionOrderError:
                for later in self.ahead:  # never issued: the run ends here
                    for group in later.groups:
                        group.pending = None
                self.ahead.clear()
                raise
            entry.issue_groups(entry.groups)

    def _compare(self, rows: list[list[int]]) -> None:
        if any(row != rows[0] for row in rows):
            raise ExecutionOrderError(self._describe(rows))

    def _describe(self, rows: list[list[int]]) -> str:
        what = [self._units_of(row) for row in rows]
        where = sorted({(PHASES[row[2]], row[0], row[1], row[3]) for row in rows})
        at = "; ".join(f"{phase} of step {step} (pass {p}), gather #{seq}" for phase, step, p, seq in where)
        return (
            f"zero3: ranks disagree on what to gather next: rank by rank they gather {what} (at {at}). "
            + REMEDY
        )

    def _units_of(self, row: list[int]) -> str:
        if PHASES[row[2]] == "trace check":
            return "nothing (it finished its backward)"
        count, named = row[5], [i for i in row[6 : 6 + NAMED_UNITS] if i >= 0]
        names = [self.names[i] if i < len(self.names) else f"unit {i}" for i in named]
        if count > NAMED_UNITS:
            names.append(f"... {count - NAMED_UNITS} more")
        return names[0] if len(names) == 1 else "+".join(names)

    def check_traces(self, traces: dict[str, list[str]]) -> None:
        """Compare the recorded traces (unit names per phase) across ranks (a collective)."""
        if not self.comm.distributed:
            return
        self.settle()
        digest = zlib.crc32(repr(sorted(traces.items())).encode())
        trace_check = PHASES.index("trace check")
        rows = self.comm.agree([self.step, self.passes, trace_check, 0, digest, 0] + [-1] * NAMED_UNITS + [0])
        if all(row == rows[0] for row in rows):
            return
        if any(row[2] != trace_check for row in rows):  # some rank is gathering instead
            raise ExecutionOrderError(self._describe(rows))
        everyone = self.comm.all_gather_objects(traces, on_check_group=True)
        lines = []
        for phase in ("forward", "backward"):
            orders = [rank_traces[phase] for rank_traces in everyone]
            if any(order != orders[0] for order in orders):
                at = next(i for i in range(max(map(len, orders))) if len({tuple(o[i : i + 1]) for o in orders}) > 1)
                found = [o[at] if at < len(o) else "nothing more" for o in orders]
                lines.append(f"in {phase}, unit #{at} is, rank by rank, {found}")
        raise ExecutionOrderError(
            f"zero3: ranks recorded different execution orders at step {self.step}: " + "; ".join(lines) + ". "
            + REMEDY
        )


class CheckedAhead:
    """The ``pending`` of groups whose gather was agreed on ahead and is not issued yet: ``issue`` issues
    it (with every gather agreed on before it), after which the groups' ``pending`` is the gather's."""

    def __init__(self, order_check: OrderCheck, agreement: Agreement, groups: list, issue: Callable[[list], None]) -> None:
        self.order_check = order_check
        self.agreement = agreement
        self.groups = groups
        self.issue_groups = issue

    def issue(self) -> None:
        self.order_check.settle()

    def ready(self) -> bool:
        return False
