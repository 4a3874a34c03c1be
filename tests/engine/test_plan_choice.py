"""The automatic plan at setup (engine/plan/choose.py, estimate.py): the sizing it takes for a budget, the
lean level it may start at on CPU ranks, and the error when nothing fits, on model figures given by hand
(the 118M GPT of docs/will-it-fit.md: 8 units of 12.6M, a 16.9M root, 2 ranks)."""

import math

import pytest

from lightning_zero3 import NothingFitsError
from lightning_zero3.engine.plan.choose import choose_plan
from lightning_zero3.engine.plan.estimate import Job, estimate_plan
from lightning_zero3.engine.plan.facts import Activations, ModelFacts

WORLD = 2
UNIT, ROOT = 12_596_224, 16_908_288
FACTS = ModelFacts(
    world_size=WORLD, total_numel=ROOT + 8 * UNIT, trainable_numel=ROOT + 8 * UNIT, root_numel=ROOT,
    unit_numels=(UNIT,) * 8, persistent_numel=0, shard_numel=math.ceil(ROOT / WORLD) + 8 * math.ceil(UNIT / WORLD),
    trainable_shard_numel=math.ceil(ROOT / WORLD) + 8 * math.ceil(UNIT / WORLD),
    group_shard_numels=(math.ceil(ROOT / WORLD),) + (math.ceil(UNIT / WORLD),) * 8,
)  # fmt: skip
ACTIVATIONS = Activations(saved=120_000_000, unit_saved=(12_000_000,) * 8)
BASELINE = 400 << 20  # a CPU rank's resident set before the model


def _job(budget: int) -> Job:
    return Job(world_size=WORLD, ranks_per_node=WORLD, on_cpu=True, device_memory=budget, baseline_device=BASELINE)


def test_returning_idle_buffers_between_phases_lowers_a_cpu_ranks_nvme_estimate_by_the_phase_it_no_longer_stacks():
    job = _job(10**12)
    kept = estimate_plan("all->nvme", "nvme", "nvme", FACTS, ACTIVATIONS, job, 2)
    trimmed = estimate_plan("all->nvme", "nvme", "nvme", FACTS, ACTIVATIONS, job, 2, trim_between_phases=True)
    backward = kept.gathered_peak + kept.grad_staging + kept.activations + 2 * 2 * 4 * math.ceil(ROOT / WORLD)
    assert trimmed.device_bytes_per_rank == kept.device_bytes_per_rank - (
        kept.gathered_peak + kept.grad_staging + kept.activations + kept.nvme_staging) + max(backward, kept.nvme_staging)
    assert trimmed.device_bytes_per_rank < kept.device_bytes_per_rank
    assert trimmed.kept_between_steps == 0 < kept.kept_between_steps
    on_gpu = Job(world_size=WORLD, ranks_per_node=WORLD)  # device and host apart: nothing to gain
    assert estimate_plan("all->nvme", "nvme", "nvme", FACTS, ACTIVATIONS, on_gpu, 2, True).device_bytes_per_rank == \
        estimate_plan("all->nvme", "nvme", "nvme", FACTS, ACTIVATIONS, on_gpu, 2).device_bytes_per_rank


def _sizings(budget: int, trim: bool) -> list:
    """Every NVMe sizing setup may try (buffer counts 4..2, prefetch on and off) of the two NVMe plans."""
    jobs = [_job(budget), Job(**{**_job(budget).__dict__, "prefetch_numel": 0})]
    return [estimate_plan(name, "nvme", par, FACTS, ACTIVATIONS, job, count, trim)
            for name, par in (("optimizer->nvme", None), ("all->nvme", "nvme")) for job in jobs for count in (4, 3, 2)]


def test_setup_takes_the_lean_level_where_only_it_fits_and_the_lighter_sizings_where_they_do():
    kept = min(e.device_bytes_per_rank for e in _sizings(0, False))
    leanest = min(e.device_bytes_per_rank for e in _sizings(0, True))
    budget = (kept + leanest) // 2  # no sizing that keeps its buffers fits
    estimate, settings, why = choose_plan(FACTS, ACTIVATIONS, _job(budget), "auto", "auto")
    assert estimate.trim_between_phases and estimate.device_bytes_per_rank <= budget
    assert settings["offload_optimizer"] == "nvme" and "idle buffers returned between phases" in why
    lightest = _sizings(0, False)[0]  # optimizer->nvme, 4 buffers, prefetch on: the fastest NVMe sizing
    roomy, settings, why = choose_plan(FACTS, ACTIVATIONS, _job(lightest.device_bytes_per_rank), "nvme", "auto")
    assert not roomy.trim_between_phases and "between phases" not in why and settings["offload_buffer_count"] == 4
    # a lighter plan with idle buffers returned comes before a deeper one that keeps them
    deeper_kept = min(e.device_bytes_per_rank for e in _sizings(0, False) if e.plan == "all->nvme")
    lighter, _, _ = choose_plan(FACTS, ACTIVATIONS, _job(deeper_kept), "auto", "auto")
    assert lighter.plan == "optimizer->nvme" and lighter.trim_between_phases


def test_nothing_fits_names_the_budget_the_deepest_plans_figures_and_what_would_help():
    leanest = min(_sizings(0, True), key=lambda e: e.device_bytes_per_rank)
    with pytest.raises(NothingFitsError) as caught:  # 50 MB short: less than the activations could give back
        choose_plan(FACTS, ACTIVATIONS, _job(leanest.device_bytes_per_rank - 50_000_000), "auto", "auto")
    message = str(caught.value)
    assert f"needs {leanest.device_bytes_per_rank / 1e9:.2f} GB" in message  # the leanest sizing is what it reports
    for part in ("no offload plan fits the memory budget", "all->nvme", "activation checkpointing",
                 "a batch of at most", "a larger `memory_budget`"):  # fmt: skip
        assert part in message
