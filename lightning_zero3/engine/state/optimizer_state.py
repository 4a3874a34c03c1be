"""Optimizer state between the sharded form (what each rank steps) and the full form (what DDP saves).

The full form is the state dict an unsharded optimizer over the whole model would have: every
per-element tensor (Adam's moments, SGD's momentum) at the full parameter's shape; per-parameter scalars
(``step``) taken from any rank that has them. It does not depend on the world size, so a checkpoint
written with N ranks loads with M ranks, and checkpoints move between zero3 and DDP.

It is produced one group and one state key at a time: ``full_state_layout`` settles which keys exist
(one small object collective), ``gathered_state`` all-gathers one key of one group (a collective). The
single-file checkpoint (``checkpoint/full.py``) writes each as it comes, so no rank holds more than one
unit's state; ``full_optimizer_state`` collects them all (for ``unshard``, which needs the whole thing).
``load_full_optimizer_state`` is the inverse: each rank keeps the slice it owns, written straight to the
swap file of a group whose state lives on NVMe.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol

import torch
from torch import nn

from ..comm.communicator import Communicator
from ..grads.optim import optimizer_params
from ..layout.slots import ParamSlot
from ..memory.buffers import drop_pages
from ..offload.aio import write_range
from ..offload.store import state_kind
from ..shard.flat_group import FlatGroup


class Sharded(Protocol):
    """What the optimizer-state code reads of the engine (``engine.Zero3Engine``; named here so this file
    needs nothing above it)."""

    comm: Communicator

    def group_of(self, shard_param: nn.Parameter) -> tuple[FlatGroup, ParamSlot]: ...


def _on_disk(group: FlatGroup) -> bool:
    return group.store is not None and group.store.offload.nvme and not group.store.resident


@dataclass
class FullStateLayout:
    """What the full state of one optimizer holds, agreed by every rank."""

    params: list[torch.nn.Parameter]  # the optimizer's shard parameters, in state-dict order
    keys_of: dict[int, set] = field(default_factory=dict)  # index -> per-element keys some rank holds
    scalars: dict[int, dict] = field(default_factory=dict)  # index -> everything else (``step``, ...)
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)  # per-element key -> dtype

    def by_group(self, engine: Sharded) -> dict[FlatGroup, list[int]]:
        groups: dict[FlatGroup, list[int]] = {}
        for index, param in enumerate(self.params):
            groups.setdefault(engine.group_of(param)[0], []).append(index)
        return groups


def full_state_layout(optimizer: torch.optim.Optimizer, engine: Sharded) -> FullStateLayout:
    """Which (parameter, key) pairs exist on some rank, and the scalars (a collective)."""
    layout = FullStateLayout(optimizer_params(optimizer))
    mine: dict[int, dict[str, str]] = {}
    scalars: dict[int, dict] = {}
    for index, param in enumerate(layout.params):
        group, _ = engine.group_of(param)
        for key, value in optimizer.state.get(param, {}).items():
            if _is_per_element(group, key, value, param):
                dtype = group.store.state_dtypes[key] if _on_disk(group) else value.dtype
                mine.setdefault(index, {})[key] = str(dtype).removeprefix("torch.")
            else:
                scalars.setdefault(index, {})[key] = value.clone() if torch.is_tensor(value) else value
    for rank_keys, rank_scalars in engine.comm.all_gather_objects((mine, scalars)):
        for index, keys in rank_keys.items():
            layout.keys_of.setdefault(index, set()).update(keys)
            layout.dtypes.update({key: getattr(torch, dtype) for key, dtype in keys.items()})
        for index, values in rank_scalars.items():
            layout.scalars.setdefault(index, {}).update(values)
    return layout


def _is_per_element(group: FlatGroup, key: str, value: Any, param: torch.Tensor) -> bool:
    if _on_disk(group):
        return key in group.store.state_dtypes  # a 0-element placeholder: the values wait in a swap file
    return torch.is_tensor(value) and value.dim() > 0 and value.shape == param.shape and value.numel() > 0


@contextmanager
def gathered_state(
    engine: Sharded, optimizer: torch.optim.Optimizer, layout: FullStateLayout, group: FlatGroup,
    indices: list[int], key: str,
) -> Iterator[torch.Tensor]:
    """State ``key`` of every parameter of ``group``, full and flat like ``group.full`` (a collective;
    in a staging buffer for the duration of the block). Elements of parameters without it are zero."""
    dtype = layout.dtypes[key]
    device = group.shard.device
    pooled = None
    if _on_disk(group) and key in group.store.state_dtypes:
        future, pooled = group.store.read_file(state_kind(key))
        group.store.offload.io.wait(future)
        local = pooled
    else:
        local = group.pool.take(group.shard_numel, dtype, device, zero=True)
        for index in indices:
            value = optimizer.state.get(layout.params[index], {}).get(key)
            if value is not None and value.numel():
                slot = engine.group_of(layout.params[index])[1]
                local[slot.lo : slot.hi].copy_(value.reshape(-1))
    full = group.pool.take(group.full.numel(), dtype, device)
    try:
        engine.comm.all_gather(full, local.to(device))
        yield full
    finally:
        group.pool.give(full)
        if pooled is not None:
            group.store.offload.host.give(pooled)
        else:
            group.pool.give(local)


def full_optimizer_state(optimizer: torch.optim.Optimizer, engine: Sharded) -> dict[str, Any]:
    """The whole full state dict in memory (a collective; for models that fit one process)."""
    layout = full_state_layout(optimizer, engine)
    state: dict[int, dict[str, Any]] = {index: dict(values) for index, values in layout.scalars.items()}
    for group, indices in layout.by_group(engine).items():
        for key in sorted({k for i in indices for k in layout.keys_of.get(i, ())}):
            with gathered_state(engine, optimizer, layout, group, indices, key) as full:
                for index in indices:
                    if key in layout.keys_of.get(index, ()):
                        slot = engine.group_of(layout.params[index])[1]
                        value = full[slot.offset : slot.offset + slot.numel].view(slot.param.shape).clone()
                        state.setdefault(index, {})[key] = value
    return {"state": state, "param_groups": optimizer.state_dict()["param_groups"]}


def load_full_optimizer_state(optimizer: torch.optim.Optimizer, full: dict[str, Any], engine: Sharded) -> None:
    """Keep this rank's slice of every per-element tensor of ``full`` (which may be memory-mapped from a
    file: its pages are dropped once read); under NVMe the slice goes straight to the state's swap file."""
    shard_params = optimizer_params(optimizer)
    local_state: dict[int, dict[str, Any]] = {}
    for index, values in full["state"].items():
        index = int(index)
        if index >= len(shard_params):
            raise ValueError(
                f"zero3: the checkpoint's optimizer state names parameter #{index}, but the optimizer has only "
                f"{len(shard_params)}; the checkpoint was written for a different model or optimizer."
            )
        group, slot = engine.group_of(shard_params[index])
        entry = {}
        for key, value in values.items():
            if torch.is_tensor(value) and value.dim() > 0 and value.shape == slot.param.shape:
                entry[key] = _keep_slice(group, slot, key, value)
            else:
                entry[key] = value.clone() if torch.is_tensor(value) else value  # never alias the caller's dict
        if slot.hi > slot.lo:
            local_state[index] = entry
    optimizer.load_state_dict({"state": local_state, "param_groups": full["param_groups"]})


def _keep_slice(group: FlatGroup, slot: ParamSlot, key: str, value: torch.Tensor) -> torch.Tensor:
    start = slot.piece_start(group.comm.rank, group.shard_numel)
    piece = value.reshape(-1)[start : start + slot.hi - slot.lo]
    if _on_disk(group):
        group.store.ensure_state(key, value.dtype)
        file, offset, _ = group.store.file_range(state_kind(key), slot.lo, slot.hi)
        write_range(file, piece.contiguous(), offset)
        kept = torch.empty(0, dtype=value.dtype)  # the placeholder of state that waits on disk
    else:
        kept = piece.clone()
    drop_pages(value)
    return kept
