"""The Trainer's side of the automatic offload plan (``offload_*="auto"``): the activations of the job's
own training step, measured on the meta device before the engine is built, and the first step's measured
peak compared with the budget (see [Note: activations at setup] in engine/plan/resolve.py)."""

from __future__ import annotations

import logging
import warnings
from typing import Any, Optional

import torch
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.data import default_collate

from ...config.settings import Zero3Config
from ...engine.memory.proc import STATUS, kib_field_bytes
from ...engine.plan import Activations, measure_activations

log = logging.getLogger("lightning_zero3")


def _meta_batch(trainer: Any) -> Optional[Any]:
    """A batch shaped like the training loader's, on the meta device: one sample of its (map-style) data
    set, repeated to its batch size. None where the loader does not say (an iterable data set, a batch
    sampler). Building the loader draws no random numbers (a shuffling sampler draws when iterated)."""
    source = trainer.fit_loop._data_source
    if not source.is_defined():
        return None
    loader = source.dataloader()
    batch_size = getattr(loader, "batch_size", None)
    dataset = getattr(loader, "dataset", None)
    if not batch_size or dataset is None or not hasattr(dataset, "__getitem__"):
        return None
    batch = (getattr(loader, "collate_fn", None) or default_collate)([dataset[0]] * batch_size)
    return tree_map(lambda t: torch.empty_like(t, device="meta") if isinstance(t, torch.Tensor) else t, batch)


def step_activations(trainer: Any, module: torch.nn.Module, config: Zero3Config) -> Optional[Activations]:
    """What one ``training_step`` of ``module`` saves for backward, for the job's batch shape; None where
    it cannot be measured (parameters not on the meta device, no batch shape, a step that fails on meta)."""
    if "auto" not in (config.offload_optimizer, config.offload_params):
        return None
    if any(not p.is_meta for p in module.parameters()):
        log.info("zero3: the automatic plan counts no activations: the model was not built on the meta device")
        return None
    owner = module._trainer
    try:
        batch = _meta_batch(trainer)
        if batch is None:
            log.info("zero3: the automatic plan counts no activations: the training batch's shape is not known")
            return None
        tokens = [t for t in tree_leaves(batch) if isinstance(t, torch.Tensor) and t.dim() >= 2]
        seq_len = tokens[0].shape[1] if tokens else None
        module._trainer = None  # ``self.log`` in the step: a no-op without a Trainer, nothing logged
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return measure_activations(module, lambda: module.training_step(batch, 0), unit_modules=config.unit_modules,
                                       persistence_threshold=config.persistence_threshold, seq_len=seq_len)  # fmt: skip
    except Exception as error:  # a step that does not run on meta tensors: the plan is chosen without them
        log.info("zero3: the automatic plan counts no activations: a meta training step failed (%s)", error)
        return None
    finally:
        module._trainer = owner


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return kib_field_bytes(STATUS, "VmHWM") or 0  # the rank's resident high-water mark so far


def first_step_warning(engine: Any) -> Optional[str]:
    """After the first training step of an automatic plan: a warning with the figures if the step's measured
    peak went over the budget the plan was chosen for (the plan cannot change now), else None."""
    estimate, budget = engine.plan_estimate, engine.plan_budget
    if estimate is None or not budget:
        return None
    peak = _peak_bytes(engine.device)
    if peak <= budget:
        return None
    what = "resident memory (VmHWM)" if engine.device.type == "cpu" else "torch.cuda.max_memory_allocated"
    return (
        f"zero3: the automatic offload plan {estimate.plan} was chosen to fit memory_budget={budget / 1e9:.3f} GB "
        f"per rank (estimated {estimate.device_bytes_per_rank / 1e9:.3f} GB), but the first training step peaked "
        f"at {peak / 1e9:.3f} GB ({what}), {(peak - budget) / 1e9:.3f} GB over. The plan cannot change while "
        "training; lower memory_budget by that much so a deeper plan is taken, turn on activation "
        "checkpointing, or use a smaller batch."
    )
