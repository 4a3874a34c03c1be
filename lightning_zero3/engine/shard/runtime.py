"""``UnitRuntime``: the live state of one planned unit (see ``layout/units.py``) while the model runs.

A unit's full parameters stay gathered while any of four reasons holds; it is released when none does:
  - ``forward_depth``: its forward is running (nested or repeated calls count separately);
  - ``backward_hold``: its backward has started (or is due right after its forward, see
    ``Schedule.keep_for_backward``) and is not over yet;
  - ``context_holds``: a ``gathered_parameters`` block is open on it;
  - ``resident``: an evaluation stage keeps it gathered across forward calls (see ``schedule/residency.py``).

Within one backward pass a unit moves through the phases of ``BackwardPhase``, only forward, and only
through ``UnitRuntime``'s methods, which check that each move is legal.
"""

from __future__ import annotations

import weakref
from enum import Enum

from ..comm.communicator import Communicator
from .flat_group import FlatGroup


class BackwardPhase(Enum):
    """Where a unit is in the current backward pass:

    IDLE --start_backward--> STARTED --end_backward--> OVER --mark_reduced--> REDUCED --reset_backward--> IDLE

    STARTED: its pre-backward hook ran. OVER: its backward is over (its post-backward signal fired, or, for
    a unit without one, every trainable parameter has its gradient, see [Note: counting a unit's
    gradients] in engine/schedule/hooks.py, or backward ended); a unit whose pre-backward hook never ran
    goes from IDLE straight to OVER. REDUCED: its gradients were packed for the reduce-scatter (see
    ``grads.ReductionQueue``); a gradient that arrives then is an error. Every unit is IDLE again when the
    pass ends."""

    IDLE = "idle"
    STARTED = "started"
    OVER = "over"
    REDUCED = "reduced"


class PostBackwardToken:
    """One forward call of a unit whose inputs need gradients; it fires when that call's backward is over.

    Held by the autograd graph (see ``hooks._PostBackward``), so a graph that is dropped without a
    backward takes its token with it (the unit keeps weak references only)."""

    __slots__ = ("__weakref__",)


class UnitRuntime:
    """The gather / release / reduce state of one flat group (a unit's, or the persistent one)."""

    def __init__(self, name: str, group: FlatGroup, comm: Communicator) -> None:
        self.name = name
        self.group = group
        self.comm = comm
        self.forward_depth = 0
        self.backward_hold = False
        self.context_holds = 0
        self.resident = False
        self.phase = BackwardPhase.IDLE  # in this backward pass
        self.grads_ready = 0  # trainable parameters whose gradient arrived (units that count them)
        self.grads_expected: int | None = None  # trainable parameters, counted once per backward pass
        self.awaiting = weakref.WeakSet()  # PostBackwardTokens of forward calls whose backward is not over
        self.signals = 0  # PostBackwardTokens made since the last backward ended

    @property
    def trainable(self) -> bool:
        return self.group.trainable

    def acquire(self) -> None:
        self.group.gather()

    def maybe_release(self) -> None:
        if not self.held():
            self.group.release()

    def held(self) -> bool:
        return self.forward_depth > 0 or self.backward_hold or self.context_holds > 0 or self.resident

    @property
    def ends_alike(self) -> bool:
        """Whether its backward ends at the same point of backward on every rank: it has a post-backward
        signal (its inputs need gradients), which every rank gets once that unit's backward has run,
        whatever parameters got gradients there (see [Note: reduction order] in engine/grads/reduction.py)."""
        return self.signals > 0

    def all_grads_in(self) -> bool:
        if self.grads_expected is None:  # asked at every gradient's arrival: counted once per pass
            self.grads_expected = len(self.group.trainable_slots)
        return self.grads_ready >= self.grads_expected

    @property
    def backward_over(self) -> bool:
        return self.phase in (BackwardPhase.OVER, BackwardPhase.REDUCED)

    def start_backward(self) -> bool:
        """Its pre-backward hook ran: hold it for its backward. False if its backward had already started
        (another of its outputs' gradients) or ended."""
        if self.phase is not BackwardPhase.IDLE:
            return False
        self.phase = BackwardPhase.STARTED
        self.backward_hold = True
        return True

    def end_backward(self) -> bool:
        """Mark its backward over (its secondary shard, if any, goes); False if it already was."""
        self.group.drop_secondary()
        if self.backward_over:
            return False
        self.phase = BackwardPhase.OVER
        self.backward_hold = False
        return True

    def mark_reduced(self) -> None:
        """Its gradients were packed for the reduce-scatter: only once its backward is over."""
        self._assert_in(BackwardPhase.OVER)
        self.phase = BackwardPhase.REDUCED

    def reset_backward(self) -> None:
        self.phase = BackwardPhase.IDLE
        self.backward_hold = False
        self.grads_ready = self.signals = 0
        self.grads_expected = None

    def _assert_in(self, *phases: BackwardPhase) -> None:
        if self.phase not in phases:
            raise AssertionError(
                f"zero3 internal error: unit {self.name!r} is {self.phase.name} in backward, expected "
                f"{' or '.join(p.name for p in phases)}"
            )
