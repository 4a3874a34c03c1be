"""What the estimate needs to know of a model, read from a model built on the meta device (no weights).

Units come from ``layout/units.py`` with the job's own ``unit_modules`` and ``persistence_threshold``, so the
estimate counts the very units, and the very padding, that the engine will build.

[Note: activations measured on the meta device]
Autograd runs on meta tensors: a forward pass of a meta model on meta inputs records the same graph, and
saves the same tensors for backward, as on a real device, with shapes and dtypes but no data and no
arithmetic (seconds for 80 layers of a 70B model). ``torch.autograd.graph.saved_tensors_hooks`` sees every
tensor saved for backward; their storages, counted once each and without the parameters' own storages (a
linear layer saves its weight: that is a gathered unit, counted there), are the activations a training
step holds when its forward ends. Forward hooks on the unit modules attribute each saved tensor to the
unit running, and record the size of each unit's input: with activation checkpointing a unit keeps only
its input, and backward recomputes one unit's saved tensors at a time. This is measurement, not a
formula; it misses what a kernel allocates outside autograd (workspace, the backward's transient
gradients), which ``estimate.py`` adds as one unit's worth. One correction: on the meta device
``scaled_dot_product_attention`` takes its math path and saves the (seq x seq) attention weights, which
the fused kernels a real run takes (flash / memory-efficient on CUDA, flash on CPU) never keep (they save
the output and a small log-sum-exp). With ``seq_len`` given, saved tensors whose last two dimensions are
both ``seq_len`` are left out: on a 70B Llama at 4096 tokens they were three quarters of the total.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from ..layout.units import plan_units


@dataclass(frozen=True)
class ModelFacts:
    """Element counts of a model as the engine will lay it out (``world_size`` ranks)."""

    world_size: int
    total_numel: int  # every distinct parameter
    trainable_numel: int
    root_numel: int  # sharded parameters of the root unit (gathered whole while forward runs)
    unit_numels: tuple[int, ...]  # every other unit, in module order
    persistent_numel: int  # small parameters every rank keeps whole
    shard_numel: int  # this rank's elements of every flat group, padding included
    trainable_shard_numel: int  # of which trainable (gradients and optimizer state are kept for these)
    group_shard_numels: tuple[int, ...]  # per flat group (root, units, persistent): one rank's shard

    @property
    def largest_unit_numel(self) -> int:
        return max(self.unit_numels, default=0)


def model_facts(module: nn.Module, unit_modules, persistence_threshold: int, world_size: int) -> ModelFacts:
    """Counts of ``module`` (any device, meta included) under the given unit policy, over ``world_size`` ranks."""
    plan = plan_units(module, unit_modules, persistence_threshold)
    groups = [(spec.params) for spec in plan.units if spec.params]
    if plan.persistent:
        groups.append(plan.persistent)
    shard = trainable_shard = 0
    group_shards = []
    for params in groups:
        numel = sum(p.numel() for _, p in params)
        per_rank = math.ceil(numel / world_size)
        group_shards.append(per_rank)
        shard += per_rank
        if any(p.requires_grad for _, p in params):
            trainable = sum(p.numel() for _, p in params if p.requires_grad)
            trainable_shard += math.ceil(trainable / world_size)
    distinct = {id(p): p for p in module.parameters()}
    return ModelFacts(
        world_size=world_size,
        total_numel=sum(p.numel() for p in distinct.values()),
        trainable_numel=sum(p.numel() for p in distinct.values() if p.requires_grad),
        root_numel=sum(p.numel() for _, p in plan.root.params),
        unit_numels=tuple(sum(p.numel() for _, p in spec.params) for spec in plan.units[1:]),
        persistent_numel=sum(p.numel() for _, p in plan.persistent),
        shard_numel=shard,
        trainable_shard_numel=trainable_shard,
        group_shard_numels=tuple(group_shards),
    )


def _never_unpacked(_: object) -> torch.Tensor:
    raise RuntimeError("zero3: a step measured for its activations is not run backward")


@dataclass(frozen=True)
class Activations:
    """Bytes saved for backward by one training step's forward (see [Note: activations measured on the meta
    device]), for the batch it was measured with."""

    saved: int  # everything saved, parameters excluded
    unit_saved: tuple[int, ...] = ()  # saved while each unit's forward ran
    unit_inputs: tuple[int, ...] = ()  # each unit's input (what checkpointing keeps of it)
    largest_tensor: int = 0

    def checkpointed(self) -> int:
        """Saved bytes with activation checkpointing on every unit: the units' inputs instead of their
        saved tensors, plus one unit recomputed at a time."""
        outside = self.saved - sum(self.unit_saved)
        return outside + sum(self.unit_inputs) + max(self.unit_saved, default=0)

    def scaled(self, factor: float) -> "Activations":
        """The same model at ``factor`` times the tokens per step (activations are linear in them)."""
        return Activations(
            int(self.saved * factor), tuple(int(b * factor) for b in self.unit_saved),
            tuple(int(b * factor) for b in self.unit_inputs), int(self.largest_tensor * factor),
        )  # fmt: skip


def measure_activations(module: nn.Module, step: Callable[[], object], units: Optional[list[nn.Module]] = None,
                        unit_modules=None, persistence_threshold: int = 0, seq_len: Optional[int] = None) -> Activations:  # fmt: skip
    """Run ``step`` (one forward and loss of ``module``, meta device welcome) and count what it saves for
    backward. ``units``: the unit modules to attribute to (default: the units ``layout/units.py`` picks)."""
    if units is None:
        units = [spec.module for spec in plan_units(module, unit_modules, persistence_threshold).units[1:]]
    params = {p.untyped_storage()._cdata for p in module.parameters()}
    saved: dict[int, int] = {}
    current: list[Optional[int]] = [None]
    per_unit = [0] * len(units)
    inputs = [0] * len(units)
    biggest = [0]
    alive: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage._cdata
        alive.append(t.detach())  # its storage stays while measuring: no later storage takes its key
        if seq_len and t.dim() >= 3 and t.shape[-1] == t.shape[-2] == seq_len:
            return None  # attention weights: fused kernels do not save them (see the Note)
        if key not in params and key not in saved:
            saved[key] = storage.nbytes()
            biggest[0] = max(biggest[0], storage.nbytes())
            if current[0] is not None:
                per_unit[current[0]] += storage.nbytes()
        # autograd keeps nothing: the step never runs backward. Handing it ``t`` itself left every parameter
        # it saved (a linear layer's weight) held after the graph was gone (torch.utils.swap_tensors then
        # refused to materialise the parameters of a model measured before the engine built it)
        return None

    handles = []
    for i, unit in enumerate(units):
        def enter(mod, args, i=i):
            current[0] = i
            inputs[i] = sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))

        def leave(mod, args, out):
            current[0] = None

        handles.append(unit.register_forward_pre_hook(enter))
        handles.append(unit.register_forward_hook(leave))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, _never_unpacked):
            step()
    finally:
        for handle in handles:
            handle.remove()
    return Activations(sum(saved.values()), tuple(per_unit), tuple(inputs), biggest[0])

