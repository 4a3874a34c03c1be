"""The automatic plan while training (engine/plan/dynamic.py): the decisions at step boundaries, on measured
figures given by hand, and the level's round trip through a checkpoint's state."""

import pytest
import torch

from lightning_zero3 import NothingFitsError
from lightning_zero3.engine.plan.dynamic import (
    MARGIN,
    RELAX_MARGIN,
    RELAX_STEPS,
    DynamicPlan,
    StepFigures,
    StepOverBudgetError,
    ladder,
)

BUDGET = 1000


class Figures:
    """A meter that reports the figures a test queues, one step at a time."""

    def __init__(self) -> None:
        self.queued: list[StepFigures] = []

    def start(self) -> None:
        pass

    def finish(self) -> StepFigures:
        return self.queued.pop(0)


def _plan(prefetch: int = 100) -> tuple[DynamicPlan, Figures, list]:
    meter, taken = Figures(), []
    plan = DynamicPlan(BUDGET, ladder(prefetch), meter, taken.append, lambda t: t)
    return plan, meter, taken


def _steps(plan: DynamicPlan, meter: Figures, figures: list[tuple[int, int]]) -> list:
    """Run steps that peak and grow as given; the changes made at their ends."""
    if not plan.running:
        plan.step_boundary(0)
    changes = []
    for step, (peak, growth) in enumerate(figures, start=1):
        meter.queued.append(StepFigures(peak, growth))
        changes.append(plan.step_boundary(step))
    return changes


def test_the_ladder_goes_from_the_plan_at_setup_to_buffers_returned_after_each_use():
    levels = ladder(100)
    assert [(lv.prefetch_numel, lv.keep_staging) for lv in levels] == [(100, True), (0, True), (0, False)]
    assert len(ladder(0)) == 2  # prefetch already off: no rung that changes nothing


def test_a_step_within_the_margin_takes_one_level_deeper_and_one_predicted_over_the_deepest():
    plan, meter, taken = _plan()
    near = int(BUDGET * (1 - MARGIN / 2))
    changes = _steps(plan, meter, [(near - 10, 10)])
    assert changes[0]["level"] == 1 and plan.level == 1 and taken == [plan.levels[1]]
    assert "within 3% of the budget" in changes[0]["reason"]
    plan, meter, taken = _plan()
    changes = _steps(plan, meter, [(BUDGET // 2, BUDGET)])  # the pools a first step fills, held for the next
    assert plan.level == plan.deepest and taken == [plan.levels[-1]]
    assert changes[0]["predicted_bytes"] == BUDGET // 2 + BUDGET


def test_quiet_steps_move_back_one_level_but_not_to_a_level_that_came_near_the_budget():
    plan, meter, _ = _plan()
    low = int(BUDGET * (1 - RELAX_MARGIN)) - 1
    _steps(plan, meter, [(low, 0)] * 3 + [(BUDGET + 1, 0)])  # level 0 went over: deepest
    assert plan.level == plan.deepest
    changes = _steps(plan, meter, [(low, 0)] * RELAX_STEPS)
    assert [c["level"] for c in changes if c] == [1]  # back to level 1 (never seen near), not to 0
    changes = _steps(plan, meter, [(low, 0)] * RELAX_STEPS * 2)
    assert not any(changes) and plan.level == 1
    changes = _steps(plan, meter, [(low, 0)] * (RELAX_STEPS - 1) + [(low + 1 + int(BUDGET * RELAX_MARGIN), 0)])
    assert not any(changes[:-1])  # a step not far below restarts the count


def test_a_step_over_the_budget_at_the_deepest_level_ends_with_the_figures_and_what_would_help():
    plan, meter, _ = _plan(prefetch=0)
    _steps(plan, meter, [(BUDGET * 2, 0)])
    assert plan.level == plan.deepest
    with pytest.raises(StepOverBudgetError) as caught:
        _steps(plan, meter, [(BUDGET + 1, 0)])
    assert isinstance(caught.value, NothingFitsError)
    message = str(caught.value)
    for part in ("memory_budget=", "peaked at", "activation checkpointing", "smaller batch"):
        assert part in message


def test_every_rank_decides_on_the_largest_figures():
    meter, taken = Figures(), []
    other_rank = torch.tensor([float(BUDGET), float(BUDGET)])
    plan = DynamicPlan(BUDGET, ladder(100), meter, taken.append, lambda mine: torch.maximum(mine, other_rank))
    _steps(plan, meter, [(10, 0)])  # this rank is far below; the other is at the budget
    assert plan.level == 1


def test_the_level_in_force_comes_back_from_its_state_and_is_taken_again():
    plan, meter, _ = _plan()
    _steps(plan, meter, [(BUDGET // 2, BUDGET)])
    state = plan.state_dict()
    resumed, _, taken = _plan()
    resumed.load_state_dict(state)
    assert resumed.level == plan.level and taken == [resumed.levels[plan.level]]
    assert resumed.changes == plan.changes and resumed.worst == plan.worst
    fewer, _, taken = _plan(prefetch=0)  # a run with prefetch off has no "prefetch off" rung: by name
    fewer.load_state_dict(state)
    assert fewer.levels[fewer.level].name == plan.levels[plan.level].name
