"""A flat group: parameters sharded together as one flat buffer.

Layout of a group of parameters p_0 .. p_k (numel n_i) on N ranks::

    full  = [ p_0 | p_1 | ... | p_k | pad ]      padded length L = N * S
    shard = full[rank * S : (rank + 1) * S]       what this rank keeps between uses

Communication is flat (one all-gather, one reduce-scatter per group), while the optimizer sees
per-parameter *shard parameters*: ``nn.Parameter`` views into ``shard`` covering the part of each user
parameter that this rank owns (possibly empty). Parameter groups, weight-decay splits and frozen
parameters therefore work unchanged over the shards.

The user's parameters become views into ``full`` (see [Note: freeing by storage resize] in memory.py).
Under offload the shard parameters view a *master* kept by the group's ``GroupStore`` in host memory or
on NVMe, and ``shard`` is only the device-side source of all-gathers (see ``offload/tiers.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch
from torch import nn

from .comm import Communicator, Pending
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

if TYPE_CHECKING:
    from .materialize import Materializer
    from .offload import Offload


@dataclass(frozen=True)
class DtypePolicy:
    """Dtypes around the shards. The *master* dtype is the parameters' own (what the shards, the gradient
    shards and the optimizer keep); ``compute`` is what parameters are gathered in and forward runs
    with; ``reduce`` is what gradients are reduce-scattered in. ``None`` means the master dtype."""

    compute: Optional[torch.dtype] = None
    reduce: Optional[torch.dtype] = None


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
        dtypes: DtypePolicy = DtypePolicy(),
        materializer: Optional["Materializer"] = None,
        offload: Optional["Offload"] = None,
    ) -> None:
        if not named_params:
            raise ValueError(f"flat group {name!r} has no parameters")
        own_dtypes = {p.dtype for _, p in named_params}
        if len(own_dtypes) != 1:
            raise TypeError(
                f"zero3: unit {name!r} mixes parameter dtypes {sorted(map(str, own_dtypes))}; convert the model "
                "to one dtype before training (the `precision` flag does this for you)."
            )
        self.name = name
        self.comm = comm
        self.ledger = ledger
        self.persistent = persistent
        self.dtype = own_dtypes.pop()  # the master dtype
        self.compute_dtype = dtypes.compute or self.dtype
        self.reduce_dtype = dtypes.reduce or self.dtype
        world, rank = comm.world_size, comm.rank
        total = sum(p.numel() for _, p in named_params)
        self.shard_numel = -(-total // world)  # ceil division
        self.numel = total
        self.shard = new_buffer(self.shard_numel, self.dtype, device)
        self.trainable = any(p.requires_grad for _, p in named_params)
        # under offload the gradient shard lives with the master, in the store
        self.grad_shard = new_buffer(self.shard_numel, self.dtype, device) if self.trainable and not offload else None

        with torch.no_grad():
            # One buffer of the full (padded) size is alive per group while it is built; it becomes ``full``
            # when the compute dtype is the master dtype, so building a unit costs one unit's bytes.
            master = new_buffer(self.shard_numel * world, self.dtype, device)
            if materializer is not None and any(p.is_meta for _, p in named_params):
                # built straight from the meta device: see [Note: sharded initialisation] in materialize.py
                materializer.fill(named_params, master[:total])
                sync_from_rank0 = True  # rank 0 initialised it
            else:
                offset = 0
                for _, p in named_params:
                    master[offset : offset + p.numel()].copy_(p.detach().reshape(-1))
                    offset += p.numel()
            if sync_from_rank0:
                comm.broadcast(master, src=0)
            start = rank * self.shard_numel
            self.shard.copy_(master[start : start + self.shard_numel])
            if self.compute_dtype == self.dtype:
                self.full = master
            else:
                self.full = new_buffer(master.numel(), self.compute_dtype, device)
                self.full.copy_(master)
            del master
        self.store = offload.new_store(self.shard, self.trainable) if offload is not None else None

        self.slots: list[ParamSlot] = []
        offset = 0
        for name_, p in named_params:
            lo = min(max(offset - start, 0), self.shard_numel)
            hi = min(max(offset + p.numel() - start, 0), self.shard_numel)
            shard_param = nn.Parameter(self.master[lo:hi], requires_grad=p.requires_grad)
            shard_param._zero3_name = name_
            p.data = self.full[offset : offset + p.numel()].view(p.shape)
            p._zero3_name = name_
            self.slots.append(ParamSlot(name_, p, p.__class__, offset, p.numel(), shard_param, lo, hi))
            offset += p.numel()

        self.ledger.add(PARAM_SHARDS, self._nbytes(self.shard))
        if self.grad_shard is not None:
            self.ledger.add(GRAD_SHARDS, self._nbytes(self.grad_shard))
        self.gathered = True
        self.pending: Optional[Pending] = None  # an all-gather in flight into ``full``
        # agrees with every rank on each all-gather before it is issued (set by the engine; see agreement.py)
        self.check: Optional[Callable[[Sequence["FlatGroup"]], None]] = None
        self._source: Optional[torch.Tensor] = None  # what it reads, kept alive until it completes
        self.ledger.add(self._full_category, self._nbytes(self.full))
        if self.store is not None:
            self.store.bind(self)

    @property
    def master(self) -> Optional[torch.Tensor]:
        """What the shard parameters view and the optimizer steps (None while swapped out to NVMe)."""
        return self.shard if self.store is None else self.store.master

    # -- gather / release -------------------------------------------------------------------------

    @property
    def _full_category(self) -> str:
        return PERSISTENT_PARAMS if self.persistent else GATHERED_PARAMS

    @staticmethod
    def _nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    def start_gather(self, force: bool = False, checked: bool = False) -> None:
        """Issue the all-gather of the full parameters without waiting for it (prefetch). ``checked``: the
        ranks already agreed on it (``start_gathers`` checks several groups at once)."""
        if self.pending is not None or (self.gathered and not force):
            return
        if not checked:
            self._agree([self])
        self._begin_fill()
        with torch.no_grad():
            shard = self.gather_input()
            self._source = shard if self.compute_dtype == self.dtype else shard.to(self.compute_dtype)
            self.pending = self.comm.all_gather(self.full, self._source, async_op=True)

    def gather_input(self) -> torch.Tensor:
        """The device shard, valid for an all-gather (under offload: refilled from its tier)."""
        return self.shard if self.store is None else self.store.fill(self.shard)

    def prefetch_input(self) -> None:
        """Start reading the parameter shard from its tier ahead of use (NVMe parameters)."""
        if self.store is not None:
            self.store.prefetch_params()

    def _gathered(self) -> None:
        """An all-gather into ``full`` completed: the device shard may go back to its tier."""
        if self.store is not None:
            self.store.unfill(self.shard)

    def _begin_fill(self) -> None:
        """Give ``full`` its memory back before a gather writes into it."""
        if not self.gathered:
            restore_storage(self.full)
            self.ledger.add(self._full_category, self._nbytes(self.full))

    def gather(self, force: bool = False) -> None:
        """Make the full parameters valid (waiting for a prefetch in flight). ``force`` re-gathers even
        when gathered (the shards changed)."""
        if self.pending is None:
            if self.gathered and not force:
                return
            self.start_gather(force)
        self.pending.wait()
        self.pending = self._source = None
        self._gathered()
        for slot in self.slots:
            mark_gathered(slot.param, slot.original_class)
        self.gathered = True

    def _agree(self, groups: Sequence["FlatGroup"]) -> None:
        if self.check is not None:
            self.check(groups)

    def gather_master(self) -> torch.Tensor:
        """A new flat tensor with the full parameters in the master dtype (for checkpoints, teardown)."""
        self._agree([self])
        flat = torch.empty(self.full.numel(), dtype=self.dtype, device=self.shard.device)
        with torch.no_grad():
            self.comm.all_gather(flat, self._master_on_device("gathering full weights"))
        return flat

    def _master_on_device(self, what: str) -> torch.Tensor:
        if self.store is None:
            return self.shard
        return self.store.require_resident(what).to(self.shard.device)

    def load_slice(self, slot: ParamSlot, full_value: torch.Tensor) -> None:
        """Set this rank's piece of ``slot``'s parameter from the parameter's full value."""
        if full_value.numel() != slot.numel:
            raise ValueError(
                f"zero3: the value for {slot.name} has {full_value.numel()} elements, the parameter "
                f"{tuple(slot.param.shape)} has {slot.numel}; the state dict was written for another model."
            )
        start = self.comm.rank * self.shard_numel + slot.lo - slot.offset
        master = self.master if self.store is None else self.store.require_resident("loading weights")
        with torch.no_grad():
            piece = full_value.reshape(-1)[start : start + slot.hi - slot.lo]
            master[slot.lo : slot.hi].copy_(piece)

    def release(self) -> None:
        """Free the full parameters (persistent groups are never released)."""
        if self.persistent:
            return
        if self.pending is not None:
            self.gather()  # a buffer may not be freed under a collective still writing into it
        if not self.gathered:
            return
        for slot in self.slots:
            mark_released(slot.param, slot.original_class)
        free_storage(self.full)
        self.ledger.remove(self._full_category, self._nbytes(self.full))
        self.gathered = False

    def write_back(self, src: int | None = None) -> None:
        """Copy the (gathered, possibly modified) full parameters into this rank's shard.

        With ``src`` set, that rank's full parameters are broadcast first, so all ranks agree. Under a
        lower compute dtype the shard receives the gathered (rounded) values.
        """
        assert self.gathered, "write_back needs the group gathered"
        with torch.no_grad():
            if src is not None:
                self.comm.broadcast(self.full, src=src)
            start = self.comm.rank * self.shard_numel
            master = self.master if self.store is None else self.store.require_resident("writing weights back")
            master.copy_(self.full[start : start + self.shard_numel])

    def unshard(self) -> None:
        """Turn the parameters back into ordinary, independent full tensors in the master dtype (at teardown)."""
        master = self.gather_master()
        for slot in self.slots:
            mark_gathered(slot.param, slot.original_class)
            slot.param.data = master[slot.offset : slot.offset + slot.numel].view(slot.param.shape).clone()
        if self.gathered:
            free_storage(self.full)
            self.ledger.remove(self._full_category, self._nbytes(self.full))
        if self.store is None or self.store.offload.param_tier is None:
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


def start_gathers(groups: list[FlatGroup], coalesce_below: int) -> None:
    """Issue the all-gathers of ``groups`` (in this order, the same on every rank) without waiting.

    Groups smaller than ``coalesce_below`` elements share one all-gather.

    [Note: coalesced all-gather]
    An all-gather concatenates the ranks' inputs rank by rank. Each rank sends its shards of several
    groups side by side, so the output is rank-major, ``[g1 slice 0 | g2 slice 0 | ... | g1 slice 1 | ...]``;
    once it lands, each group's column block is copied into its own ``full`` buffer.
    """
    waiting = [g for g in groups if g.pending is None and not g.gathered]
    if waiting:
        waiting[0]._agree(waiting)  # one check for the unit and its prefetches
    small = [g for g in waiting if g.full.numel() < coalesce_below]
    for group in waiting:
        if group not in small or len(small) == 1:
            group.start_gather(checked=True)
        elif group is small[0]:
            _start_coalesced(small)


def _start_coalesced(groups: list[FlatGroup]) -> None:
    comm, world = groups[0].comm, groups[0].comm.world_size
    widths = [g.shard_numel for g in groups]
    with torch.no_grad():
        source = torch.cat([g.gather_input().to(g.compute_dtype) for g in groups])
        for group in groups:
            group._gathered()  # the concatenated copy is what the collective reads
        landing = torch.empty(world, sum(widths), dtype=source.dtype, device=source.device)
        pending = comm.all_gather(landing.view(-1), source, async_op=True)

    def scatter_columns() -> None:
        offset = 0
        for group, width in zip(groups, widths):
            group.full.view(world, width).copy_(landing[:, offset : offset + width])
            offset += width

    shared = _Then(pending, scatter_columns)
    for group in groups:
        group._begin_fill()
        group.pending, group._source = shared, source


class _Then:
    """A pending collective followed, once, by a finishing step (shared by the groups it serves)."""

    def __init__(self, pending: Pending, then) -> None:
        self._pending, self._then, self.done = pending, then, False

    def wait(self) -> None:
        if not self.done:
            self._pending.wait()
            with torch.no_grad():
                self._then()
            self.done = True
