"""Will it fit: per-rank memory of each offload plan, estimated before any weight is placed, and the
choice of a plan under a memory budget. Imports ``memory`` and ``layout`` only, and the package's ``config``
(units come from ``layout/units.py``, so the estimate counts the very units the engine will build).

    facts.py      what the estimate needs to know of a model: units, persistent and trainable elements,
                  activations measured on the meta device
    estimate.py   the figures of each plan, per rank and per node
    choose.py     the lightest plan that fits a budget, sized to it; the error when none does
    resolve.py    ``offload_*="auto"`` at setup: the budget, the facts, the plan taken
    dynamic.py    the budget held while training: a leaner or faster level at step boundaries

The rest of the offload plan: ``frontends/trainer/auto_plan.py`` (the Trainer's side: a training step's
activations measured before the engine is built, the strategy's call at every step boundary) and
``cli/estimate/`` (``lightning-zero3 estimate``: the same figures for a job's YAML, before any run).
"""

from .choose import NothingFitsError, choose_plan
from .dynamic import StepOverBudgetError
from .estimate import PLANS, Job, PlanEstimate, estimate_plans
from .facts import Activations, ModelFacts, measure_activations, model_facts

__all__ = [
    "PLANS",
    "Activations",
    "Job",
    "ModelFacts",
    "NothingFitsError",
    "PlanEstimate",
    "StepOverBudgetError",
    "choose_plan",
    "estimate_plans",
    "measure_activations",
    "model_facts",
]
