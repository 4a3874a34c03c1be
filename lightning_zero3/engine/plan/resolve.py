"""``offload_*="auto"`` at setup: the engine's side of the automatic plan (see [Note: how the automatic plan
decides] in choose.py).

What is measured here: the budget (``memory_budget``, or free memory less 10%) and the runtime baseline
(on CPU this process's resident set at setup; on CUDA the bytes already allocated). The activations come
from the caller (see [Note: activations at setup]).

[Note: activations at setup]
The engine is built before any training step, so it cannot see one. Measuring the first step and
choosing then would be too late: by then the weights are placed in the tiers of some plan. So the
strategy measures a step on the meta device before the engine is built, as ``lightning-zero3 estimate``
does (``measure_activations``): the LightningModule's own ``training_step`` on a meta batch shaped like
the job's (one sample of the training set, repeated to the loader's batch size; see frontends/trainer/strategy.py). That
needs the model's parameters still on the meta device (built in ``configure_model`` or under
``Trainer.init_module(empty_init=True)``, the way a model too big for one process is built anyway) and a
map-style training set. Where either is missing the activations count as 0 and the log says so; the
steps' measured peaks then move the plan at step boundaries (see [Note: the plan at step boundaries] in
dynamic.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Optional

import torch
from torch import nn

from ...config.settings import Zero3Config, parse_budget
from ..memory.proc import MEMINFO, STATUS, kib_field_bytes
from .choose import choose_plan
from .estimate import Job, PlanEstimate
from .facts import Activations, model_facts

log = logging.getLogger("lightning_zero3")
MARGIN = 0.10  # of free memory left aside when memory_budget is "auto"


def _status_bytes(key: str) -> int:
    return kib_field_bytes(STATUS, key) or 0


def _available_host() -> int:
    return kib_field_bytes(MEMINFO, "MemAvailable") or 0


def budget_bytes(config: Zero3Config, device: torch.device, local_ranks: int) -> int:
    if config.memory_budget not in (None, "auto"):
        return int(parse_budget(config.memory_budget))
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * (1 - MARGIN))
    return int((_available_host() + _status_bytes("VmRSS")) * (1 - MARGIN) / max(local_ranks, 1))


def resolve_auto(module: nn.Module, config: Zero3Config, world_size: int, local_ranks: int, device: torch.device,
                 master_bytes: int, compute_bytes: int, activations: Optional[Activations] = None,
                 ) -> tuple[Zero3Config, PlanEstimate, str, int]:  # fmt: skip
    """The config with ``"auto"`` replaced by the chosen plan and the settings sized to the budget, the plan's
    figures, why it was taken, and the budget in bytes.
    ``activations``: one training step's, measured on the meta device (None: not known, counted as 0)."""
    on_cpu = device.type == "cpu"
    budget = budget_bytes(config, device, local_ranks)
    baseline = _status_bytes("VmRSS") if on_cpu else torch.cuda.memory_allocated(device)
    facts = model_facts(module, config.unit_modules, config.persistence_threshold, world_size)
    job = Job(
        world_size=world_size, ranks_per_node=local_ranks, master_bytes=master_bytes, compute_bytes=compute_bytes,
        prefetch_numel=config.prefetch_bucket_size, max_live_numel=config.max_live_parameters,
        buffer_count=config.offload_buffer_count, on_cpu=on_cpu, device_memory=budget, baseline_device=baseline,
    )  # fmt: skip
    measured = activations is not None
    estimate, settings, why = choose_plan(facts, activations or Activations(0), job, config.offload_optimizer,
                                          config.offload_params)  # fmt: skip
    act = estimate.activations_checkpointed if job.activation_checkpointing else estimate.activations
    why += (f"; activations {act / 1e9:.2f} GB, measured on the meta device" if measured else
            "; activations not known at setup (counted as 0; the steps' peaks adjust the plan while training)")
    resolved = dataclasses.replace(config, memory_budget=None, **settings)
    log.info("zero3: offload plan %s (%s)", estimate.plan, why)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"zero3: offload plan {estimate.plan}: {why}", flush=True)
    return resolved, estimate, why, budget
