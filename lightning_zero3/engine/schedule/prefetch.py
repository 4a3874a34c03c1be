"""Execution-order trace and the prefetch window.

While *recording* (every forward until the first backward has finished), the schedule writes down the
order in which units start forward and backward. At the end of every backward the traces are compared
across ranks (``OrderCheck.check_traces``, one tiny collective where the ranks wait for each other's
reduce-scatters anyway): the reduction order is derived from the backward trace, so it must be the same
everywhere, and a rank whose order changed differently from the others' fails there, on every rank,
with the differing units named. (Whether ranks gather the same units is checked at every gather, see
[Note: every all-gather is checked] in engine/comm/agreement.py.)

After that, the traces drive prefetch: when a unit starts, the next units in the trace are gathered
asynchronously, as many as fit in ``prefetch_bucket_size`` elements, with at most
``MAX_INFLIGHT_GATHERS`` gathers in flight and never more than ``max_live_parameters`` elements
gathered, so peak memory is the same every step.

[Note: the trace may change]
A model may change its execution order between steps, the same way on every rank: a layer dropped by a
draw from a shared seed, a different number of model calls per step, generation that stops at a length
all ranks agree on. When a unit starts out of trace order (or a pass ends before its trace does), the
trace of that phase is re-recorded from that point for the rest of the pass, prefetch stops for the
rest of the pass, and the gathers already prefetched for the old order are released by the hooks (every
rank prefetched the same units, so every rank releases the same ones). From the next pass on, prefetch
follows the new trace. ``trace_changes`` counts the training steps whose order changed; when most steps
change it, prefetch gathers units that are not used next (``CommMonitor`` says so). A rank whose order
changes differently from the others fails at the next gather or at the end of that backward, on every
rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Optional

import torch

from ..comm.agreement import ExecutionOrderError, OrderCheck

if TYPE_CHECKING:
    from ..shard.runtime import UnitRuntime

__all__ = ["ExecutionOrderError", "Schedule", "Start", "MAX_INFLIGHT_GATHERS"]

MAX_INFLIGHT_GATHERS = 2
PHASES = ("forward", "backward")


class Start(NamedTuple):
    ahead: list  # units to gather ahead of use, in order
    changed: bool  # the unit ran out of trace order: what was prefetched for the old order is stale


class Schedule:
    def __init__(
        self,
        units: list["UnitRuntime"],
        check: OrderCheck,
        prefetch_numel: int,
        max_live_numel: int,
        max_reuse_distance: int = 0,
    ) -> None:
        self.units = units
        self.check = check
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self.traces: dict[str, list["UnitRuntime"]] = {"forward": [], "backward": []}
        self.cursors = {"forward": 0, "backward": 0}
        self.recording = {"forward": True, "backward": True}
        self.first_recording = True  # every pass records until the first backward has finished
        self._rerecording = {"forward": False, "backward": False}  # see [Note: the trace may change]
        self._recorded_this_step = False  # a trace changed in this step: reuse distances are recomputed
        self._changed_this_step = False
        self.phase = "outside"  # or "forward" / "backward" while a pass runs
        self.max_reuse_distance = max_reuse_distance
        self.reuse_distance: dict[int, int] = {}  # unit -> elements gathered between its forward and backward
        self.prefetched = 0  # gathers issued ahead of use
        self.prefetch_hits = 0  # units that were already gathered (or in flight) when they started
        self.starts = 0  # units started (forward or backward): the hit rate's denominator
        self.steps = 0  # backward passes finished
        self.trace_changes = 0  # backward passes whose forward or backward order differed from the trace

    def begin(self, phase: str) -> None:
        """A new forward (root starts) or backward (first unit's backward starts)."""
        self.check.enter(phase)
        self.phase = phase
        self.cursors[phase] = 0
        if self.first_recording and self.recording[phase]:
            self.traces[phase] = []
        elif self._rerecording[phase]:
            self.recording[phase] = self._rerecording[phase] = False  # the new order is the trace now

    def end_forward(self) -> None:
        """The root's forward returned. Before any training step, a forward with gradients off (evaluation
        only: predict, generation) makes its order the forward trace, so later calls are prefetched."""
        self._end_pass("forward")
        if self.first_recording and self.recording["forward"] and self.traces["forward"] and not torch.is_grad_enabled():
            self.recording["forward"] = False
        self.check.enter("outside")
        self.phase = "outside"

    def end_backward(self) -> None:
        """The backward pass is over (every rank calls this at the same point). Compares the traces across
        ranks if they were recorded in this step; may raise ``ExecutionOrderError``."""
        self._end_pass("backward")
        ending_first = self.first_recording and bool(self.traces["forward"])
        if ending_first:
            self.first_recording = False
            self.recording = {"forward": False, "backward": False}
        if self._rerecording["backward"]:
            self.recording["backward"] = self._rerecording["backward"] = False
        if ending_first or self._recorded_this_step:
            self.reuse_distance = self._reuse_distances()
        self._recorded_this_step = False
        self.steps += 1
        self.trace_changes += self._changed_this_step
        self._changed_this_step = False
        self.phase = "outside"
        try:
            if not self.first_recording:
                self.check.check_traces({p: [u.name for u in self.traces[p]] for p in PHASES})
        finally:
            self.check.end_backward()

    def _end_pass(self, phase: str) -> None:
        """A pass that stopped before its trace did changes the trace too (the trace is cut there)."""
        cursor, trace = self.cursors[phase], self.traces[phase]
        if not self.recording[phase] and 0 < cursor < len(trace):
            self.traces[phase] = trace[:cursor]
            self._note_change()

    def _note_change(self) -> None:
        self._recorded_this_step = True
        if torch.is_grad_enabled() or self.phase == "backward":  # a training pass (evaluation is not counted)
            self._changed_this_step = True

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

    def on_start(self, phase: str, unit: "UnitRuntime") -> Start:
        """Record or follow ``unit`` starting ``phase``; returns the units to gather ahead."""
        self.starts += 1
        if unit.group.gathered or unit.group.pending is not None:
            self.prefetch_hits += 1
        trace, cursor = self.traces[phase], self.cursors[phase]
        if self.recording[phase]:
            trace.append(unit)
            self.cursors[phase] = len(trace)
            return Start([], False)
        if cursor < len(trace) and trace[cursor] is unit:
            self.cursors[phase] = cursor + 1
            return Start(self._window(trace, cursor + 1, unit), False)
        # [Note: the trace may change]: re-record this phase from here
        self.traces[phase] = trace[:cursor] + [unit]
        self.cursors[phase] = cursor + 1
        self.recording[phase] = self._rerecording[phase] = True
        self._note_change()
        return Start([], True)

    def ahead_of_next(self, phase: str, from_start: bool = False) -> list["UnitRuntime"]:
        """The units to gather ahead of the next unit of ``phase``, from a point that is not a unit's start:
        the root's start (the next unit of the trace; a root called inside its own forward, as Lightning's
        forward redirection runs ``validation_step``, continues the pass rather than opening one), or the
        end of a forward for its backward (``from_start``). None while recording, and with one process,
        whose gathers are copies with nothing to run behind (its units start their own)."""
        if self.recording[phase] or not self.check.checks_ahead:
            return []
        return self._window(self.traces[phase], 0 if from_start else self.cursors[phase], None)

    def upcoming(self, phase: str, count: int, wrap: bool = False) -> list["UnitRuntime"]:
        """The next ``count`` units of the recorded trace not gathered yet (none while recording). ``wrap``:
        past the end of the trace, continue from its start (evaluation: the next call runs the same units,
        so reading them ahead keeps the disk busy across calls)."""
        if self.recording[phase] or count <= 0:
            return []
        trace = self.traces[phase][self.cursors[phase] :]
        if wrap:
            trace = trace + self.traces[phase][: self.cursors[phase]]
        chosen = [unit for unit in trace if not unit.group.gathered and unit.group.pending is None]
        return list(dict.fromkeys(chosen))[:count]

    def _window(self, trace: list["UnitRuntime"], start: int, starting: Optional["UnitRuntime"]) -> list["UnitRuntime"]:
        candidates = [unit for unit in trace[start:] if not unit.group.gathered and unit.group.pending is None]
        if not candidates:  # everything ahead is gathered or on its way (one process keeps every unit so)
            return []
        # Gathers in flight once this start is over. Gathers agreed on ahead are issued at the next start
        # (see [Note: checks run a unit ahead] in engine/comm/agreement.py), when the unit starting now is no longer
        # in flight: it is not counted then, so the same number of gathers is issued ahead of need.
        issued_next = starting if self.check.checks_ahead else None
        live = inflight = 0  # elements gathered or on their way; gathers in flight (one pass: every start asks)
        for rt in self.units:
            if rt.group.pending is not None:
                live += rt.group.full.numel()
                inflight += rt is not issued_next
            elif rt.group.gathered:
                live += rt.group.full.numel()
        chosen, budget = [], self.prefetch_numel
        for unit in candidates:
            if unit in chosen:
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
