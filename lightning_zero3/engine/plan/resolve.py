"""``offload_*="auto"`` at setup: the engine's side of the automatic plan (see [Note: how the automatic plan
decides] in choose.py).

What is measured here: the budget (``memory_budget``, or free memory less 10%) and the runtime baseline
(on CPU this process's resident set at setup; on CUDA the bytes already allocated). What is not yet:
the activations (the engine sees no training step at setup; they count as 0 here, so a budget must leave
room for them: ``lightning-zero3 estimate`` prints them).
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch
from torch import nn

from ...config import Zero3Config, parse_budget
from .choose import choose_plan
from .estimate import Job, PlanEstimate
from .facts import Activations, model_facts

log = logging.getLogger("lightning_zero3")
MARGIN = 0.10  # of free memory left aside when memory_budget is "auto"


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _available_host() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def budget_bytes(config: Zero3Config, device: torch.device, local_ranks: int) -> int:
    if config.memory_budget not in (None, "auto"):
        return int(parse_budget(config.memory_budget))
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * (1 - MARGIN))
    return int((_available_host() + _status_bytes("VmRSS")) * (1 - MARGIN) / max(local_ranks, 1))


def resolve_auto(module: nn.Module, config: Zero3Config, world_size: int, local_ranks: int, device: torch.device,
                 master_bytes: int, compute_bytes: int) -> tuple[Zero3Config, PlanEstimate, str]:  # fmt: skip
    """The config with ``"auto"`` replaced by the chosen plan and the settings sized to the budget."""
    on_cpu = device.type == "cpu"
    budget = budget_bytes(config, device, local_ranks)
    baseline = _status_bytes("VmRSS") if on_cpu else torch.cuda.memory_allocated(device)
    facts = model_facts(module, config.unit_modules, config.persistence_threshold, world_size)
    job = Job(
        world_size=world_size, ranks_per_node=local_ranks, master_bytes=master_bytes, compute_bytes=compute_bytes,
        prefetch_numel=config.prefetch_bucket_size, max_live_numel=config.max_live_parameters,
        buffer_count=config.offload_buffer_count, on_cpu=on_cpu, device_memory=budget, baseline_device=baseline,
    )  # fmt: skip
    estimate, settings, why = choose_plan(facts, Activations(0), job, config.offload_optimizer, config.offload_params)
    resolved = dataclasses.replace(config, memory_budget=None, **settings)
    log.info("zero3: offload plan %s (%s)", estimate.plan, why)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"zero3: offload plan {estimate.plan}: {why}", flush=True)
    return resolved, estimate, why
