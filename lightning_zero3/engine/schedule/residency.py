"""Inference residency: which units stay gathered from one evaluation forward call to the next.

In a training step every unit must be gathered again for every forward and backward (the shards change
at each step). In evaluation the weights do not change, and a model called many times per batch
(generation: once per new token) would all-gather its whole self again for every call. So in an
evaluation stage (``validate`` / ``test`` / ``predict``, or forward calls with gradients off outside the
Trainer) some units stay gathered across calls, up to ``inference_memory_budget`` bytes; the others are
gathered per call as in training, prefetched along the recorded order.

[Note: choosing the resident units]
Which units: the first evaluation calls are a *profile*: every unit is gathered per call, and for each the
seconds the forward actually waited for its gather (the transfer time prefetch did not hide behind
compute) are measured. Keeping a unit resident saves that wait on every later call and costs its gathered
bytes, so the plan is a 0/1 knapsack: maximise the total wait saved within the budget (dynamic programming
over the bytes, in steps of 1/1000 of the budget). Units whose wait was not measurable still save the
gathers' own work (and their bandwidth): they fill what budget is left, largest wait first. The plan holds
for the stage; leaving it releases every resident unit, and memory is back where training left it.

[Note: the automatic budget]
``"auto"`` never lets evaluation use more memory than a training step: a training step holds, at its
peak, the units it gathers (the root, the running unit, prefetched ones) and its gradient staging
buffers; evaluation needs no gradient staging and keeps a streaming window for the non-resident units
(the root and up to three of the largest units). "auto" is the training step's peak of gathered plus
staging bytes (measured by the ledger when this engine has trained; else the bound a training step
reaches: the streaming window plus gradient staging for three of the largest units) minus that streaming
window.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

from ...config.settings import Budget, parse_budget
from ..memory import parking

#: profile calls: the first warms the prefetch pipeline and the allocator, the next ones are measured
PROFILE_CALLS = 3


@dataclass
class UnitProfile:
    """What one unit costs and saves in evaluation."""

    nbytes: int  # gathered bytes
    waited: float = 0.0  # seconds the forward waited for its gathers, over the measured calls
    gathers: int = 0


@dataclass
class ResidencyPlan:
    budget: int
    resident: list = field(default_factory=list)  # the units kept gathered (runtimes)
    resident_bytes: int = 0
    saved_seconds_per_call: float = 0.0


def choose_resident(units: Iterable, profiles: dict[int, UnitProfile], budget: int, steps: int = 1000) -> ResidencyPlan:
    """The units to keep gathered within ``budget`` bytes (see [Note: choosing the resident units])."""
    units = [u for u in units if id(u) in profiles and 0 < profiles[id(u)].nbytes <= budget]
    plan = ResidencyPlan(budget)
    if not units or budget <= 0:
        return plan
    quantum = max(1, -(-budget // steps))
    weights = [-(-profiles[id(u)].nbytes // quantum) for u in units]  # rounded up: never over budget
    values = [profiles[id(u)].waited / max(1, profiles[id(u)].gathers) for u in units]
    capacity = budget // quantum
    best = [0.0] * (capacity + 1)
    keep = [[False] * (capacity + 1) for _ in units]
    for i, (weight, value) in enumerate(zip(weights, values)):
        if value <= 0:
            continue
        for room in range(capacity, weight - 1, -1):
            if best[room - weight] + value > best[room]:
                best[room] = best[room - weight] + value
                keep[i][room] = True
    chosen, room = set(), capacity
    for i in range(len(units) - 1, -1, -1):
        if keep[i][room]:
            chosen.add(i)
            room -= weights[i]
    used = sum(profiles[id(units[i])].nbytes for i in chosen)
    for i in sorted(range(len(units)), key=lambda i: -values[i]):  # what is left: the rest, by measured wait
        if i not in chosen and used + profiles[id(units[i])].nbytes <= budget:
            chosen.add(i)
            used += profiles[id(units[i])].nbytes
    plan.resident = [units[i] for i in sorted(chosen)]
    plan.resident_bytes = used
    plan.saved_seconds_per_call = sum(values[i] for i in chosen)
    return plan


def auto_budget(training_peak: Optional[int], root_bytes: int, unit_bytes: list[int]) -> int:
    """The automatic budget (see [Note: the automatic budget])."""
    largest = sorted(unit_bytes, reverse=True)
    window = root_bytes + sum(largest[:3])
    if training_peak is None:  # gathered as in evaluation, plus gradient staging for three of the largest
        training_peak = window + 3 * (largest[0] if largest else 0)
    return max(0, training_peak - window)


class Residency:
    """The residency plan of evaluation stages, driven by the hooks and the strategy.

    A stage starts when the Trainer enters ``validate`` / ``test`` / ``predict`` (``enter(stage=True)``), or
    at a forward call with gradients off outside a stage; it ends when the Trainer leaves the stage, or at
    the next forward call with gradients on (training again). During the first ``PROFILE_CALLS`` calls the
    hooks report how long each unit's gather made the forward wait (``record``); at the start of the next
    call the ranks pool their profiles (a collective: every rank makes the same calls, as they must for the
    gathers anyway) and every rank derives the same plan, so all gather the same units."""

    def __init__(
        self, candidates: list, comm, ledger, setting: Budget, root_bytes: int, unit_bytes: list[int], schedule
    ) -> None:
        self.candidates = candidates  # the root (if it has sharded parameters) and every unit
        self.root = candidates[0] if root_bytes and candidates else None
        self.schedule = schedule  # how many training steps ran (``steps``)
        self.comm = comm
        self.ledger = ledger
        self.setting = parse_budget(setting)
        self.root_bytes, self.unit_bytes = root_bytes, unit_bytes
        self.active = False
        self.by_stage = False
        self.calls = 0
        self.profiles: dict[int, UnitProfile] = {}
        self.plan: Optional[ResidencyPlan] = None
        self.first = None  # the unit whose starts count the calls
        self.plans_made = 0  # for tests and monitors
        self.last_plan_bytes = 0  # bytes the last plan kept gathered

    def budget(self) -> int:
        if self.setting != "auto":
            return int(self.setting)
        trained = self.ledger.peak_training_transient if self.schedule.steps else None
        return auto_budget(trained, self.root_bytes, self.unit_bytes)

    def enter(self, stage: bool) -> None:
        if self.active:
            self.by_stage = self.by_stage or stage
            return
        self.active, self.by_stage, self.calls, self.plan, self.first = True, stage, 0, None, None
        self.profiles = {id(rt): UnitProfile(rt.group.full.numel() * rt.group.full.element_size()) for rt in self.candidates}
        self.ledger.evaluating = True

    def leave(self) -> None:
        """The stage is over: every resident unit is released (memory back to where training left it)."""
        if not self.active:
            return
        for runtime in self.plan.resident if self.plan else []:
            runtime.resident = False
            runtime.maybe_release()
        parking.flush()  # the last released unit's pages too (see [Note: released pages are parked])
        self.active, self.by_stage, self.plan = False, False, None
        self.ledger.evaluating = False

    def forward_call(self, grad_enabled: bool) -> None:
        """The root's forward starts (outside backward): a forward with gradients off starts a stage outside
        the Trainer, one with gradients on ends it."""
        if grad_enabled:
            if self.active and not self.by_stage:
                self.leave()  # training again
            return
        self.enter(stage=False)

    def unit_started(self, runtime) -> None:
        """A unit starts its forward in a stage, before it is gathered. Calls are counted at the first unit
        the stage started (a model called inside one outer call, as a generation loop in
        ``validation_step`` does, makes one call per pass through its units); the plan is made when the
        profile calls are done, at the same unit start on every rank."""
        if not self.active:
            return
        if self.first is None and (runtime is not self.root or len(self.candidates) == 1):
            self.first = runtime  # not the root: one root call may hold many model calls (generate in predict_step)
        if runtime is self.first:
            if self.plan is None and self.calls >= PROFILE_CALLS:
                self._make_plan()
            self.calls += 1

    @property
    def profiling(self) -> bool:
        return self.active and self.plan is None and self.calls > 1  # the first call warms up

    def record(self, runtime, waited: float) -> None:
        profile = self.profiles.get(id(runtime))
        if profile is not None and self.profiling:
            profile.waited += waited
            profile.gathers += 1

    def _make_plan(self) -> None:
        mine = {i: (p.waited, p.gathers) for i, p in enumerate(self.profiles[id(rt)] for rt in self.candidates)}
        pooled = self.comm.all_gather_objects(mine) if self.comm.distributed else [mine]
        profiles = {}
        for i, runtime in enumerate(self.candidates):  # the slowest rank's wait: it holds the others up
            waited = max(rank[i][0] / max(1, rank[i][1]) for rank in pooled)
            profiles[id(runtime)] = UnitProfile(self.profiles[id(runtime)].nbytes, waited, 1)
        self.plan = choose_resident(self.candidates, profiles, self.budget())
        self.last_plan_bytes = self.plan.resident_bytes
        for runtime in self.plan.resident:
            runtime.resident = True  # gathered at its next start, then kept
        self.plans_made += 1
