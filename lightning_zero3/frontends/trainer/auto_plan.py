"""The Trainer's side of the automatic offload plan (``offload_*="auto"``): the activations of the job's
own training step, measured on the meta device before the engine is built (see [Note: activations at
setup] in engine/plan/resolve.py). While training, the plan holds its budget at step boundaries (see
[Note: the plan at step boundaries] in engine/plan/dynamic.py)."""

from __future__ import annotations

import logging
import warnings
from typing import Any, Optional

import torch
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.data import default_collate

from ...config.settings import Zero3Config
from ...engine.plan import Activations, measure_activations

log = logging.getLogger("lightning_zero3")


def _meta_batch(trainer: Any) -> Optional[Any]:
    """A batch shaped like the training loader's, on the meta device: one sample of its (map-style) data
    set, repeated to its batch size: the largest where the data module names it (``largest_sample_index()``,
    as the jsonl and image-text modules do), else the first. None where the loader does not say (an iterable data set, a batch
    sampler). Building the loader draws no random numbers (a shuffling sampler draws when iterated)."""
    source = trainer.fit_loop._data_source
    if not source.is_defined():
        return None
    loader = source.dataloader()
    batch_size = getattr(loader, "batch_size", None)
    dataset = getattr(loader, "dataset", None)
    if not batch_size or dataset is None or not hasattr(dataset, "__getitem__"):
        return None
    largest = getattr(trainer.datamodule, "largest_sample_index", None)  # where the data module knows it
    sample = dataset[largest() if callable(largest) else 0]
    batch = (getattr(loader, "collate_fn", None) or default_collate)([sample] * batch_size)
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
