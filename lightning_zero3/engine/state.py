"""Optimizer state between the sharded form (what each rank steps) and the full form (what DDP saves).

``full_optimizer_state`` turns this rank's optimizer state dict into the one an unsharded optimizer
over the whole model would have: every per-element tensor (Adam's moments, SGD's momentum) is
gathered to the full parameter's shape; per-parameter scalars (``step``) are taken from any rank that
has them. ``load_full_optimizer_state`` is the inverse: each rank keeps the slice it owns. Both are
collectives (every rank calls them), and the full form does not depend on the world size, so a
checkpoint written with N ranks loads with M ranks, and checkpoints move between zero3 and DDP.

This holds the full state on every rank for a moment: fine for the single-file checkpoints Lightning
writes by default, not for models whose state does not fit one host.
"""

from __future__ import annotations

from typing import Any

import torch

from .comm import Communicator
from .optim import optimizer_params
from .shard import FlatGroup, ParamSlot


def full_optimizer_state(
    optimizer: torch.optim.Optimizer, slot_of_shard: dict[int, tuple[FlatGroup, ParamSlot]], comm: Communicator
) -> dict[str, Any]:
    local = optimizer.state_dict()
    shard_params = optimizer_params(optimizer)
    per_element, scalars = _split_state(local["state"], shard_params)
    # one object collective settles which (parameter, key) pairs exist on some rank, and the scalars
    layout = {index: sorted(values) for index, values in per_element.items()}
    everyone = comm.all_gather_objects((layout, scalars))
    keys_of: dict[int, set] = {}
    full_state: dict[int, dict[str, Any]] = {}
    for rank_layout, rank_scalars in everyone:
        for index, keys in rank_layout.items():
            keys_of.setdefault(index, set()).update(keys)
        for index, values in rank_scalars.items():
            full_state.setdefault(index, {}).update(values)

    for group, indices in _by_group(shard_params, slot_of_shard).items():
        for key in sorted({k for i in indices for k in keys_of.get(i, ())}):
            flat = torch.zeros(group.shard_numel, dtype=group.shard.dtype, device=group.shard.device)
            for index in indices:
                value = per_element.get(index, {}).get(key)
                if value is not None:
                    slot = slot_of_shard[id(shard_params[index])][1]
                    flat[slot.lo : slot.hi].copy_(value.reshape(-1))
            gathered = torch.empty(group.full.numel(), dtype=flat.dtype, device=flat.device)
            comm.all_gather(gathered, flat)
            for index in indices:
                if key in keys_of.get(index, ()):
                    slot = slot_of_shard[id(shard_params[index])][1]
                    full = gathered[slot.offset : slot.offset + slot.numel].view(slot.param.shape)
                    full_state.setdefault(index, {})[key] = full.clone()
    return {"state": full_state, "param_groups": local["param_groups"]}


def load_full_optimizer_state(
    optimizer: torch.optim.Optimizer,
    full: dict[str, Any],
    slot_of_shard: dict[int, tuple[FlatGroup, ParamSlot]],
    comm: Communicator,
) -> None:
    shard_params = optimizer_params(optimizer)
    local_state: dict[int, dict[str, Any]] = {}
    for index, values in full["state"].items():
        index = int(index)
        if index >= len(shard_params):
            raise ValueError(
                f"zero3: the checkpoint's optimizer state names parameter #{index}, but the optimizer has only "
                f"{len(shard_params)}; the checkpoint was written for a different model or optimizer."
            )
        shard_param = shard_params[index]
        group, slot = slot_of_shard[id(shard_param)]
        if slot.hi == slot.lo:
            continue  # this rank owns no element of that parameter
        start = comm.rank * group.shard_numel + slot.lo - slot.offset
        entry = {}
        for key, value in values.items():
            if torch.is_tensor(value) and value.dim() > 0 and value.shape == slot.param.shape:
                entry[key] = value.reshape(-1)[start : start + slot.hi - slot.lo].clone()
            else:
                entry[key] = value.clone() if torch.is_tensor(value) else value  # never alias the caller's dict
        local_state[index] = entry
    optimizer.load_state_dict({"state": local_state, "param_groups": full["param_groups"]})


def _split_state(state: dict, shard_params: list) -> tuple[dict, dict]:
    """Per-element tensors (shaped like the shard parameter) apart from everything else."""
    per_element: dict[int, dict] = {}
    scalars: dict[int, dict] = {}
    for index, values in state.items():
        shape = shard_params[index].shape
        for key, value in values.items():
            if torch.is_tensor(value) and value.shape == shape and value.numel() > 0 and value.dim() > 0:
                per_element.setdefault(index, {})[key] = value
            else:
                scalars.setdefault(index, {})[key] = value.clone() if torch.is_tensor(value) else value
    return per_element, scalars


def _by_group(shard_params: list, slot_of_shard: dict) -> dict[FlatGroup, list[int]]:
    groups: dict[FlatGroup, list[int]] = {}
    for index, param in enumerate(shard_params):
        groups.setdefault(slot_of_shard[id(param)][0], []).append(index)
    return groups
