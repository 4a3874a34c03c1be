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
reaches: the root and six of the largest units) minus that streaming window.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, Optional, Union

Budget = Union[int, str, None]

#: profile calls: the first warms the prefetch pipeline and the allocator, the next ones are measured
PROFILE_CALLS = 3


def parse_budget(value: Budget) -> Union[int, str]:
    """``"auto"``, or a number of bytes from an int or a string such as ``"2GB"`` / ``"512MiB"``."""
    if value is None:
        return 0
    if value == "auto":
        return "auto"
    if isinstance(value, bool):
        raise ValueError(f"{value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"{value!r}")
        return int(value)
    match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?)B?\s*", str(value), flags=re.IGNORECASE)
    if not match:
        raise ValueError(f"{value!r}")
    base = 1024 if match.group(3) else 1000
    power = " KMGT".index(match.group(2).upper() or " ")
    return int(float(match.group(1)) * base**power)


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
    if training_peak is None:
        training_peak = root_bytes + sum((largest * 6)[:6]) if largest else root_bytes
    return max(0, training_peak - window)
