"""Filling a sharded model from sources: each rank reads its own pieces (see [Note: loading straight
into shards] in engine/layout/sources.py)."""

from __future__ import annotations

from typing import Optional, Protocol, Sequence

import torch
from torch import nn

from ..comm.communicator import Communicator
from ..layout.sources import PendingValues, read_whole
from ..memory.buffers import return_free_heap
from ..shard.runtime import UnitRuntime


class Loaded(Protocol):
    """What loading reads of the engine (``engine.Zero3Engine``; named here so this file needs nothing above it)."""

    comm: Communicator
    module: nn.Module
    runtimes: Sequence[UnitRuntime]

    def settle(self) -> None: ...


class LoadError(RuntimeError):
    """Reading a checkpoint into the shards failed on some rank; every rank raises it."""


def load_sources(engine: Loaded, values: PendingValues) -> None:
    """Write this rank's piece of every parameter that has a source (persistent ones whole), and every
    buffer that has one; then refresh what reads the masters (offload tiers, secondary shards, units
    gathered right now). Every rank calls it; the only collectives are a re-gather of the units gathered
    at this moment (the same on every rank) and, with several ranks, one exchange of the outcome, so a
    failure on one rank fails them all."""
    error: Optional[str] = None
    try:
        engine.settle()
        _read_all(engine, values)
    except Exception as failure:  # noqa: BLE001 - every rank learns of it below
        error = f"{type(failure).__name__}: {failure}"
        if engine.comm.world_size == 1:
            raise
    if engine.comm.world_size > 1:
        failed = [(rank, e) for rank, e in enumerate(engine.comm.all_gather_objects(error)) if e]
        if failed:
            rank, message = failed[0]
            raise LoadError(
                f"zero3: loading the checkpoint failed on rank {rank}: {message}. The model's weights are "
                "incomplete on every rank; fix the checkpoint and load it again."
            )
    for runtime in engine.runtimes:
        group = runtime.group
        group.drop_secondary()
        if group.source is not None:
            group.source.refresh()
        if group.gathered and not group.persistent:
            group.gather(force=True)
    return_free_heap()


def _read_all(engine: Loaded, values: PendingValues) -> None:
    with torch.no_grad():
        for runtime in engine.runtimes:
            group = runtime.group
            for slot in group.slots:
                source = values.params.get(id(slot.param))
                if source is not None:
                    group.load_piece(slot, source)
                    source.release()
        if values.buffers:
            owners = {id(m): m for m in engine.module.modules()}
            for (owner, name), source in values.buffers.items():
                read_whole(source, owners[owner]._buffers[name])
                source.release()
