"""The lightest plan that fits a memory budget, and what the engine sizes to it.

[Note: how the automatic plan decides]
``offload_optimizer="auto"`` / ``offload_params="auto"`` leave the tier to the engine; a fixed value on
either side narrows the plans it may take (``offload_optimizer="nvme"`` with ``offload_params="auto"``
tries the two NVMe plans). The plans are tried lightest first (``estimate.PLANS``: the order in which each
costs more time per step than the one before). A plan fits when its device bytes per rank are within
``memory_budget`` (and its host bytes per node within the host's memory, where that is known). What the
engine controls is sized before a plan is given up: an NVMe plan is tried with ``offload_buffer_count``
from the configured value down to 2 (the least that overlaps reads with the step), then with prefetch off,
so the budget buys the deepest read-ahead it can hold. The first plan that fits is taken; if none does,
``NothingFitsError`` names the figures of the deepest plan and what would make it fit.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from ...config.settings import OffloadTier
from .estimate import PLANS, Job, PlanEstimate, estimate_plan
from .facts import Activations, ModelFacts


class NothingFitsError(MemoryError):
    """No offload plan fits the memory budget."""


def allowed_plans(offload_optimizer: Optional[str], offload_params: Optional[str]) -> list[tuple]:
    """The plans of ``PLANS`` that the two settings allow (``"auto"`` on a side allows any tier there)."""
    return [
        plan for plan in PLANS
        if offload_optimizer in ("auto", plan[1]) and offload_params in ("auto", plan[2])
    ]  # fmt: skip


def choose_plan(facts: ModelFacts, activations: Activations, job: Job, offload_optimizer: Optional[str],
                offload_params: Optional[str]) -> tuple[PlanEstimate, dict, str]:  # fmt: skip
    """The plan to run, the settings sized to the budget (``offload_buffer_count``, ``prefetch_bucket_size``),
    and a sentence saying why. Raises ``NothingFitsError`` when nothing fits ``job.device_memory``."""
    tried: list[PlanEstimate] = []
    for name, opt, par in allowed_plans(offload_optimizer, offload_params):
        counts = range(job.buffer_count, 1, -1) if opt == OffloadTier.NVME else [job.buffer_count]
        sizings = [(trim, prefetch, count) for trim in (False, True) for prefetch in dict.fromkeys([job.prefetch_numel, 0])
                   for count in counts]  # fmt: skip
        for trim, prefetch, count in sizings:
            sized = dataclasses.replace(job, prefetch_numel=prefetch)
            estimate = estimate_plan(name, opt, par, facts, activations, sized, count, trim)
            if estimate.fits is not False:
                lighter = ", ".join(f"{t.plan} needs {t.device_bytes_per_rank / 1e9:.2f} GB at least" for t in tried)
                why = (f"{name} is the lightest plan that fits {job.device_memory / 1e9:.2f} GB per rank: "
                       f"{estimate.device_bytes_per_rank / 1e9:.2f} GB estimated with offload_buffer_count={count}, "
                       f"prefetch_bucket_size={prefetch}" + (", idle buffers returned between phases" if trim else "")
                       + (f" (lighter plans do not fit: {lighter})" if lighter else ""))  # fmt: skip
                settings = {"offload_optimizer": opt, "offload_params": par,
                            "offload_buffer_count": count, "prefetch_bucket_size": prefetch}  # fmt: skip
                return estimate, settings, why
        tried.append(estimate)  # at its smallest sizing: what the error reports
    raise NothingFitsError(_nothing_fits(tried, facts, activations, job))


def _nothing_fits(tried: list[PlanEstimate], facts: ModelFacts, activations: Activations, job: Job) -> str:
    deepest = tried[-1]
    budget = job.device_memory or 0
    over = deepest.device_bytes_per_rank - budget
    parts = [f"{k} {getattr(deepest, k) / 1e9:.2f} GB" for k in (
        "param_shards", "grad_shards", "optimizer_state", "persistent_params", "gathered_peak", "grad_staging",
        "nvme_staging", "baseline")]  # fmt: skip
    act = deepest.activations_checkpointed if job.activation_checkpointing else deepest.activations
    lines = [
        f"zero3: no offload plan fits the memory budget of {budget / 1e9:.2f} GB per rank (tried "
        + ", ".join(f"{t.plan}: {t.device_bytes_per_rank / 1e9:.2f} GB" for t in tried) + ").",
        f"The deepest plan, {deepest.plan}, needs {deepest.device_bytes_per_rank / 1e9:.2f} GB: activations "
        f"{act / 1e9:.2f} GB, " + ", ".join(parts) + f"; {over / 1e9:.2f} GB too much.",
        "What would make it fit:",
    ]
    if not job.activation_checkpointing and deepest.activations - deepest.activations_checkpointed > over:
        lines.append(f"- activation checkpointing (activations {deepest.activations_checkpointed / 1e9:.2f} GB)")
    if act > over:
        share = max(0.0, 1 - over / act)
        lines.append(f"- a batch of at most {share:.0%} of this one per rank (activations scale with it)")
    sharded = deepest.param_shards + deepest.grad_shards + deepest.optimizer_state
    on_device_states = sharded if not deepest.offload_params else 0
    if on_device_states + deepest.gathered_peak > 0:
        lines.append(f"- more ranks: each holds 1/N of the shards (now {facts.world_size})")
    lines.append(f"- a larger `memory_budget` (at least {deepest.device_bytes_per_rank / 1e9:.2f} GB)")
    return "\n".join(lines)
