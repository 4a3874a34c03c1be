"""The automatic plan while training: the memory budget held for the whole run by changing, at a step
boundary, what the engine keeps between its uses (see choose.py for the plan taken at setup).

[Note: the plan at step boundaries]
The plan chosen at setup comes from an estimate; a step can still peak above it (the staging pools fill
during the first step and are held from then on, a later batch is longer than the first). So at every
step boundary each rank measures the step that just ended: its peak (the whole-run high-water mark where the
step raised it: the allocator's ``max_memory_allocated`` on CUDA, the resident ``VmHWM`` on CPU; else the
larger of the bytes held at its two ends) and its growth (the bytes still held at its
end that were not at its start: buffers kept for the next step, which the next step peaks on top of). The
next step is predicted to peak at ``peak + growth`` (the first step at the estimate the plan was chosen
with, the same on every rank). One all-reduce gives every rank the largest figures, so all ranks take
the same decision:

- predicted over the budget: the deepest level at once; within ``MARGIN`` of it: one level deeper;
- a level whose step peaks stay below ``(1 - RELAX_MARGIN)`` of the budget for ``RELAX_STEPS`` steps
  moves back one level, unless the lighter level once predicted within ``MARGIN`` of the budget (it is not
  tried again: on CPU the whole-run high-water mark cannot come down, so a try that goes over is lost);
- at the deepest level, a step whose peak went more than ``OVER`` over the budget ends the run on every
  rank with ``StepOverBudgetError`` (figures, and what would help), instead of an out-of-memory kill later.
  The plan moves before a prediction comes within ``MARGIN``; a step it could not foresee (the first,
  predicted by the estimate, which counts less than a real step holds) may end a little above it, so
  the run gives up only past ``OVER``.

[Note: the plan's levels]
From the plan taken at setup (``ladder``): prefetch off (units are gathered when they run, not ahead), then
idle buffers returned between phases: the engine's staging pool (gradient landing and reduce-scatter
buffers, gather landing zones) is trimmed when backward has reduced every gradient, and after each
optimizer step offload's writes are waited for and its host buffers and the staging pool trimmed, so
forward starts with none of them kept and the optimizer step's NVMe staging never sits on top of
backward's. Every such buffer is a memory map of its own (memory/buffers.py): a trim hands its pages to
the kernel at once, and the next phase faults them in again (a slower step for a lower peak; on a 118M
GPT with everything on NVMe the peak went from 1,377 to 1,104 MiB per rank). Within a phase buffers are
still reused: returning each after its use instead raised a 40M GPT's peak (815 to 848 MB).

The levels change no number that training computes (only when buffers are fetched and whether idle ones
are kept), so losses are those of the plan at setup. The level in force, and the highest prediction seen
at each level, go into sharded checkpoints (``state_dict``), so a resumed run starts where this one was.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..memory.proc import STATUS, kib_field_bytes
from .choose import NothingFitsError

log = logging.getLogger("lightning_zero3")

MARGIN = 0.03  # a predicted peak within this share of the budget takes a deeper level
OVER = 0.05  # a peak this far over the budget at the deepest level ends the run
RELAX_MARGIN = 0.15  # peaks this far below the budget ...
RELAX_STEPS = 20  # ... for this many steps in a row move back one level


class StepOverBudgetError(NothingFitsError):
    """A training step peaked over ``memory_budget`` at the deepest level the plan can take."""


@dataclass(frozen=True)
class Level:
    """One rung of the ladder: what the engine does between uses of its buffers."""

    name: str
    prefetch_numel: int  # ``prefetch_bucket_size`` in force
    trim_between_phases: bool  # idle staging buffers go back when backward ends and after the optimizer step


LEAN = "idle buffers returned between phases"


def ladder(prefetch_numel: int, trim_between_phases: bool = False) -> list[Level]:
    """The levels from the plan chosen at setup (first, with its ``prefetch_numel`` and whether it already
    trims between phases) to the leanest (last); each changes something."""
    levels = [Level("as chosen at setup", prefetch_numel, trim_between_phases)]
    if prefetch_numel:
        levels.append(Level("prefetch off", 0, trim_between_phases))
    if not trim_between_phases:
        levels.append(Level(f"prefetch off, {LEAN}", 0, True))
    return levels


@dataclass
class StepFigures:
    """One step's memory, as measured on this rank (bytes)."""

    peak: int
    growth: int

    @property
    def predicted(self) -> int:
        return self.peak + self.growth


class StepMeter:
    """Reads a step's peak and growth, device-agnostic (see [Note: the plan at step boundaries]). The
    whole-run high-water marks (``VmHWM``, ``max_memory_allocated``) are read, never reset: they stay what the
    user reads, so a step's peak is known where it raised the mark, else bounded by the held bytes at its ends."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.start_held = 0
        self.start_mark = 0

    def _held(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return kib_field_bytes(STATUS, "VmRSS") or 0

    def _mark(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return kib_field_bytes(STATUS, "VmHWM") or 0

    def start(self) -> None:
        self.start_held, self.start_mark = self._held(), self._mark()

    def finish(self) -> StepFigures:
        held, mark = self._held(), self._mark()
        peak = mark if mark > self.start_mark else max(held, self.start_held)
        return StepFigures(peak, max(0, held - self.start_held))


class DynamicPlan:
    """Holds ``budget`` bytes per rank over the whole run by moving along ``levels``; ``apply(level)`` makes
    the engine take a level, ``all_reduce_max(tensor)`` gives every rank the largest figures."""

    def __init__(self, budget: int, levels: list[Level], meter: StepMeter, apply: Callable[[Level], None],
                 all_reduce_max: Callable[[torch.Tensor], torch.Tensor], estimate: Optional[int] = None) -> None:  # fmt: skip
        self.budget = budget
        self.estimate = estimate  # the setup estimate: the first step's prediction (None once used or resumed)
        self.levels = levels
        self.meter = meter
        self.apply = apply
        self.all_reduce_max = all_reduce_max
        self.level = 0
        self.worst: dict[int, int] = {}  # level -> highest predicted peak seen under it (all ranks)
        self.whole_peak = 0  # highest step peak seen (all ranks)
        self.quiet_steps = 0
        self.changes: list[dict] = []  # every change: step, from, to, reason, figures
        self.running = False

    @property
    def deepest(self) -> int:
        return len(self.levels) - 1

    def step_boundary(self, step: int) -> Optional[dict]:
        """Call before every training step (``step``: the optimizer steps done): measures the step that ended,
        takes the level for the next one; returns the change made (None: none). Collective: every rank calls."""
        change = None
        if self.estimate is not None:  # the first step: predicted by the estimate the plan was chosen with
            # each rank estimated (and, for memory_budget="auto", measured its budget) alone: agree first
            agreed = self.all_reduce_max(torch.tensor([self.estimate, -self.budget], dtype=torch.float64))
            estimate, self.budget, self.estimate = int(agreed[0]), int(-agreed[1]), None
            change = self._decide(step, estimate, estimate, "the estimate at setup")
        elif self.running:
            mine = self.meter.finish()
            figures = self.all_reduce_max(torch.tensor([mine.peak, mine.predicted], dtype=torch.float64))
            peak, predicted = int(figures[0]), int(figures[1])
            self.whole_peak = max(self.whole_peak, peak)
            self.worst[self.level] = max(self.worst.get(self.level, 0), predicted)
            change = self._decide(step, peak, predicted)
        self.running = True
        self.meter.start()
        return change

    def _decide(self, step: int, peak: int, predicted: int, source: Optional[str] = None) -> Optional[dict]:
        budget = self.budget
        if self.level == self.deepest and peak > budget * (1 + OVER):
            raise StepOverBudgetError(self._over_budget(step, peak))
        if predicted > budget * (1 - MARGIN) and self.level < self.deepest:
            target = self.deepest if predicted > budget else self.level + 1
            where = "over the budget" if predicted > budget else f"within {MARGIN:.0%} of the budget"
            why = (f"step {step} peaked at {peak / 2**20:.0f} MiB per rank and holds {(predicted - peak) / 2**20:.0f} "
                   f"MiB more for the next: {predicted / 2**20:.0f} MiB predicted, {where}")
            if source is not None:
                why = f"{source}, {predicted / 2**20:.0f} MiB per rank, is {where}"
            return self._take(step, target, why, peak, predicted)
        relaxed = predicted < budget * (1 - RELAX_MARGIN)
        self.quiet_steps = self.quiet_steps + 1 if relaxed else 0
        lighter = self.level - 1
        if self.quiet_steps >= RELAX_STEPS and lighter >= 0 and self.worst.get(lighter, 0) < budget * (1 - MARGIN):
            why = (f"{self.quiet_steps} steps peaked below {1 - RELAX_MARGIN:.0%} of the budget (last "
                   f"{predicted / 2**20:.0f} MiB predicted)")
            return self._take(step, lighter, why, peak, predicted)
        return None

    def _take(self, step: int, target: int, why: str, peak: int, predicted: int) -> dict:
        change = {"step": step, "from": self.levels[self.level].name, "to": self.levels[target].name,
                  "level": target, "reason": why, "peak_bytes": peak, "predicted_bytes": predicted,
                  "budget_bytes": self.budget}  # fmt: skip
        self.level, self.quiet_steps = target, 0
        self.apply(self.levels[target])
        self.changes.append(change)
        message = (f"zero3: memory_budget {self.budget / 2**20:.0f} MiB per rank: plan level {target} "
                   f"({change['to']}) from step {step}: {why}")
        log.info(message)
        if int(os.environ.get("RANK", "0")) == 0:
            print(message, flush=True)
        return change

    def _over_budget(self, step: int, peak: int) -> str:
        return (
            f"zero3: training step {step} peaked at {peak / 2**20:.0f} MiB per rank (the largest over the ranks), "
            f"{peak / self.budget - 1:.1%} over memory_budget={self.budget / 2**20:.0f} MiB (more than the "
            f"{OVER:.0%} tolerated), with the leanest plan already in force "
            f"({self.levels[self.deepest].name}; shards, gradients and optimizer state offloaded as chosen at "
            "setup). Nothing more can be moved off at a step boundary. What would help: activation "
            "checkpointing (the activations are most of what a step adds), a smaller batch or shorter "
            "sequences per rank, more ranks, or a larger memory_budget (at least "
            f"{peak / 2**20:.0f} MiB)."
        )

    # -- checkpoints ----------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"level": self.level, "level_name": self.levels[self.level].name, "budget_bytes": self.budget,
                "worst": {str(k): v for k, v in self.worst.items()}, "whole_peak_bytes": self.whole_peak,
                "changes": list(self.changes)}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        """Resume at the level a checkpoint was written under (the same ladder: same settings)."""
        names = [level.name for level in self.levels]
        level = names.index(state["level_name"]) if state["level_name"] in names else self.deepest
        if state["level_name"] not in names:  # other settings than the checkpoint's (prefetch off here): the leanest
            log.info("zero3: plan level %r of the checkpoint is not one of this run's; starting at %r",
                     state["level_name"], names[level])
        self.worst = {int(k): int(v) for k, v in state.get("worst", {}).items()}
        self.whole_peak = int(state.get("whole_peak_bytes", 0))
        self.changes = list(state.get("changes", []))
        self.level, self.quiet_steps, self.running, self.estimate = level, 0, False, None
        self.apply(self.levels[level])
