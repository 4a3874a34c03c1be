"""A flat group: parameters sharded together as one flat buffer.

Layout of a group of parameters p_0 .. p_k (numel n_i) on N ranks::

    full  = [ p_0 | p_1 | ... | p_k | pad ]      padded length L = N * S
    shard = full[rank * S : (rank + 1) * S]       what this rank keeps between uses

Communication is flat (one all-gather, one reduce-scatter per group), while the optimizer sees
per-parameter *shard parameters*: ``nn.Parameter`` views into ``shard`` covering the part of each user
parameter that this rank owns (possibly empty). Parameter groups, weight-decay splits and frozen
parameters therefore work unchanged over the shards.

The user's parameters become views into ``full`` (see [Note: freeing by storage resize] in memory.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .comm import Communicator
from .memory import (
    GATHERED_PARAMS,
    GRAD_SHARDS,
    PARAM_SHARDS,
    PERSISTENT_PARAMS,
    ByteLedger,
    free_storage,
    new_buffer,
    restore_storage,
)
from .released import mark_gathered, mark_released


@dataclass(frozen=True)
class ParamSlot:
    """Where one user parameter lives: in ``full`` at ``offset`` and, on this rank, ``shard[lo:hi]``."""

    name: str
    param: nn.Parameter
    original_class: type
    offset: int
    numel: int
    shard_param: nn.Parameter  # this rank's piece of ``param``, a view into the group's shard
    lo: int  # the piece's position inside ``shard``
    hi: int


class FlatGroup:
    """Parameters that are gathered, released and reduced together."""

    def __init__(
        self,
        name: str,
        named_params: list[tuple[str, nn.Parameter]],
        comm: Communicator,
        ledger: ByteLedger,
        device: torch.device,
        persistent: bool = False,
        sync_from_rank0: bool = True,
    ) -> None:
        if not named_params:
            raise ValueError(f"flat group {name!r} has no parameters")
        dtypes = {p.dtype for _, p in named_params}
        if len(dtypes) != 1:
            raise TypeError(
                f"zero3: unit {name!r} mixes parameter dtypes {sorted(map(str, dtypes))}; convert the model "
                "to one dtype before training (the `precision` flag does this for you)."
            )
        self.name = name
        self.comm = comm
        self.ledger = ledger
        self.persistent = persistent
        self.dtype = dtypes.pop()
        world, rank = comm.world_size, comm.rank
        total = sum(p.numel() for _, p in named_params)
        self.shard_numel = -(-total // world)  # ceil division
        self.numel = total
        self.full = new_buffer(self.shard_numel * world, self.dtype, device)
        self.shard = new_buffer(self.shard_numel, self.dtype, device)
        self.grad_shard = (
            new_buffer(self.shard_numel, self.dtype, device) if any(p.requires_grad for _, p in named_params) else None
        )

        offset = 0
        with torch.no_grad():
            for _, p in named_params:
                self.full[offset : offset + p.numel()].copy_(p.detach().reshape(-1))
                offset += p.numel()
            if sync_from_rank0:
                comm.broadcast(self.full, src=0)
            start = rank * self.shard_numel
            self.shard.copy_(self.full[start : start + self.shard_numel])

        self.slots: list[ParamSlot] = []
        offset = 0
        for name_, p in named_params:
            lo = min(max(offset - start, 0), self.shard_numel)
            hi = min(max(offset + p.numel() - start, 0), self.shard_numel)
            shard_param = nn.Parameter(self.shard[lo:hi], requires_grad=p.requires_grad)
            shard_param._zero3_name = name_
            p.data = self.full[offset : offset + p.numel()].view(p.shape)
            p._zero3_name = name_
            self.slots.append(ParamSlot(name_, p, p.__class__, offset, p.numel(), shard_param, lo, hi))
            offset += p.numel()

        self.ledger.add(PARAM_SHARDS, self._nbytes(self.shard))
        if self.grad_shard is not None:
            self.ledger.add(GRAD_SHARDS, self._nbytes(self.grad_shard))
        self.gathered = True
        self.ledger.add(self._full_category, self._nbytes(self.full))

    # -- gather / release -------------------------------------------------------------------------

    @property
    def _full_category(self) -> str:
        return PERSISTENT_PARAMS if self.persistent else GATHERED_PARAMS

    @staticmethod
    def _nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    def gather(self, force: bool = False) -> None:
        """Make the full parameters valid. ``force`` re-gathers even when gathered (shards changed)."""
        if self.gathered and not force:
            return
        if not self.gathered:
            restore_storage(self.full)
            self.ledger.add(self._full_category, self._nbytes(self.full))
        with torch.no_grad():
            self.comm.all_gather(self.full, self.shard)
        for slot in self.slots:
            mark_gathered(slot.param, slot.original_class)
        self.gathered = True

    def release(self) -> None:
        """Free the full parameters (persistent groups are never released)."""
        if not self.gathered or self.persistent:
            return
        for slot in self.slots:
            mark_released(slot.param, slot.original_class)
        free_storage(self.full)
        self.ledger.remove(self._full_category, self._nbytes(self.full))
        self.gathered = False

    def write_back(self, src: int | None = None) -> None:
        """Copy the (gathered, possibly modified) full parameters into this rank's shard.

        With ``src`` set, that rank's full parameters are broadcast first, so all ranks agree.
        """
        assert self.gathered, "write_back needs the group gathered"
        with torch.no_grad():
            if src is not None:
                self.comm.broadcast(self.full, src=src)
            start = self.comm.rank * self.shard_numel
            self.shard.copy_(self.full[start : start + self.shard_numel])

    def unshard(self) -> None:
        """Turn the parameters back into ordinary, independent full tensors (at teardown)."""
        self.gather()
        for slot in self.slots:
            slot.param.data = slot.param.data.clone()
        free_storage(self.full)
        self.ledger.remove(self._full_category, self._nbytes(self.full))
        self.ledger.remove(PARAM_SHARDS, self._nbytes(self.shard))
        if self.grad_shard is not None:
            self.ledger.remove(GRAD_SHARDS, self._nbytes(self.grad_shard))
        self.gathered = False
        self.slots = []

    # -- views ------------------------------------------------------------------------------------

    @property
    def params(self) -> list[nn.Parameter]:
        return [slot.param for slot in self.slots]

    @property
    def trainable_slots(self) -> list[ParamSlot]:
        return [slot for slot in self.slots if slot.param.requires_grad]
