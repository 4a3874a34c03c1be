"""Execution-order trace and the prefetch window.

While *recording* (every forward until the first backward has finished), the schedule writes down the
order in which units start forward and backward, and checks at each unit that every rank is at the
same unit (a tiny all-reduce of the unit's index): ranks that would run different units fail there with
an error naming both modules, instead of hanging in mismatched all-gathers.

After that, the traces drive prefetch: when a unit starts, the next units in the trace are gathered
asynchronously, as many as fit in ``prefetch_bucket_size`` elements, with at most
``MAX_INFLIGHT_GATHERS`` gathers in flight and never more than ``max_live_parameters`` elements
gathered, so peak memory is the same every step. A unit that runs out of trace order afterwards is an
error: prefetching would otherwise issue collectives that other ranks do not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .comm import Communicator

if TYPE_CHECKING:
    from .hooks import UnitRuntime

MAX_INFLIGHT_GATHERS = 2


class ExecutionOrderError(RuntimeError):
    """Ranks run units in different orders, or the order changed after the first step."""


class Schedule:
    def __init__(
        self,
        units: list["UnitRuntime"],
        comm: Communicator,
        prefetch_numel: int,
        max_live_numel: int,
        max_reuse_distance: int = 0,
    ) -> None:
        self.units = units
        self.index = {id(rt): i for i, rt in enumerate(units)}
        self.comm = comm
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self.recording = True
        self.traces: dict[str, list["UnitRuntime"]] = {"forward": [], "backward": []}
        self.cursors = {"forward": 0, "backward": 0}
        self.max_reuse_distance = max_reuse_distance
        self.reuse_distance: dict[int, int] = {}  # unit -> elements gathered between its forward and backward
        self.prefetched = 0  # gathers issued ahead of use
        self.prefetch_hits = 0  # units that were already gathered (or in flight) when they started
        self.starts = 0  # units started (forward or backward): the hit rate's denominator

    def begin(self, phase: str) -> None:
        """A new forward (root starts) or backward (first unit's backward starts)."""
        self.cursors[phase] = 0
        if self.recording:
            self.traces[phase] = []

    def end_backward(self) -> None:
        if self.recording and self.traces["forward"]:
            self.recording = False
            self.reuse_distance = self._reuse_distances()

    def keep_for_backward(self, unit: "UnitRuntime") -> bool:
        """Whether ``unit`` stays gathered from its forward to its backward: so it does when the units
        gathered in between hold at most ``max_reuse_distance`` elements (the last unit: none at all).
        DeepSpeed: ``stage3_max_reuse_distance``."""
        distance = self.reuse_distance.get(id(unit))
        return distance is not None and distance <= self.max_reuse_distance

    def _reuse_distances(self) -> dict[int, int]:
        forward, backward = self.traces["forward"], self.traces["backward"]
        distances = {}
        for unit in set(forward) & set(backward):
            after = forward[len(forward) - forward[::-1].index(unit) :]
            before = backward[: backward.index(unit)]
            distances[id(unit)] = sum(rt.group.full.numel() for rt in after + before)
        return distances

    def on_start(self, phase: str, unit: "UnitRuntime") -> list["UnitRuntime"]:
        """Record or check ``unit`` starting ``phase``; returns the units to gather ahead."""
        self.starts += 1
        if unit.group.gathered or unit.group.pending is not None:
            self.prefetch_hits += 1
        if self.recording:
            self._check_ranks_agree(phase, unit)
            self.traces[phase].append(unit)
            return []
        trace, cursor = self.traces[phase], self.cursors[phase]
        if cursor >= len(trace) or trace[cursor] is not unit:
            expected = trace[cursor].name if cursor < len(trace) else "nothing more"
            raise ExecutionOrderError(
                f"zero3: in {phase}, unit {unit.name!r} ran where the first step ran {expected!r}. zero3 needs "
                "every step to run its units in the same order on every rank (as DDP needs the same "
                "parameters used on every rank); make the control flow of forward independent of the data."
            )
        self.cursors[phase] = cursor + 1
        return self._window(trace, cursor + 1)

    def upcoming(self, phase: str, count: int) -> list["UnitRuntime"]:
        """The next ``count`` units of the recorded trace not gathered yet (none while recording)."""
        if self.recording or count <= 0:
            return []
        trace = self.traces[phase][self.cursors[phase] :]
        return [unit for unit in trace if not unit.group.gathered and unit.group.pending is None][:count]

    def _window(self, trace: list["UnitRuntime"], start: int) -> list["UnitRuntime"]:
        live = sum(rt.group.full.numel() for rt in self.units if rt.group.gathered or rt.group.pending is not None)
        inflight = sum(1 for rt in self.units if rt.group.pending is not None)
        chosen, budget = [], self.prefetch_numel
        for unit in trace[start:]:
            if unit.group.gathered or unit.group.pending is not None:
                continue
            size = unit.group.full.numel()
            if size > budget or inflight >= MAX_INFLIGHT_GATHERS or live + size > self.max_live_numel:
                break
            chosen.append(unit)
            budget -= size
            live += size
            inflight += 1
        self.prefetched += len(chosen)
        return chosen

    def _check_ranks_agree(self, phase: str, unit: "UnitRuntime") -> None:
        index = self.index[id(unit)]
        if self.comm.all_equal(index):
            return
        names = [self.units[i].name if 0 <= i < len(self.units) else "?" for i in self.comm.all_gather_objects(index)]
        raise ExecutionOrderError(
            f"zero3: ranks disagree on the next unit in {phase}: rank by rank they start {names}. Every rank "
            "must run the same modules in the same order; make the control flow of forward independent "
            "of the data (or of the rank)."
        )
