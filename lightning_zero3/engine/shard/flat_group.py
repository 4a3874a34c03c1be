"""A flat group: parameters sharded together as one flat buffer.

Layout of a group of parameters p_0 .. p_k (numel n_i) on N ranks::

    full  = [ p_0 | p_1 | ... | p_k | pad ]      padded length L = N * S
    shard = full[rank * S : (rank + 1) * S]       what this rank keeps between uses

Communication is flat (one all-gather, one reduce-scatter per group), while the optimizer sees
per-parameter *shard parameters*: ``nn.Parameter`` views into the *master* covering the part of each user
parameter that this rank owns (possibly empty). Parameter groups, weight-decay splits and frozen
parameters therefore work unchanged over the shards.

Words used below: the *master* is what the shard parameters view and the optimizer steps (``shard``
itself without offload); ``shard`` is the device-side source of this rank's all-gathers; ``full`` is the
gathered buffer the user's parameters view (see [Note: releasing gathered buffers] in engine/memory/buffers.py). Under
offload the master lives in a ``GroupStore`` (host memory or NVMe) and the all-gather source is refilled
by a ``ParamSource``; the group hands both the views they need and then only calls them.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Collection, Iterator, Optional, Sequence

import torch
from torch import nn

from ..comm.communicator import Communicator
from ..layout.released import engine_access, mark_gathered, mark_released
from ..layout.slots import DtypePolicy, ParamSlot
from ..memory.buffers import (
    GATHERED_PARAMS,
    GRAD_SHARDS,
    PARAM_SHARDS,
    PERSISTENT_PARAMS,
    BufferPool,
    ByteLedger,
    new_buffer,
    reclaim,
    releasable_buffer,
    release,
)
from .gather import Then, issue, route_of

if TYPE_CHECKING:
    from ..comm.agreement import OrderCheck
    from ..layout.materialize import Materializer
    from ..layout.sources import TensorSource
    from ..offload import GroupStore, Offload, ParamSource
    from .secondary import SecondaryShard


def _one_dtype(name: str, named_params: list[tuple[str, nn.Parameter]]) -> torch.dtype:
    if not named_params:
        raise ValueError(f"flat group {name!r} has no parameters")
    own_dtypes = {p.dtype for _, p in named_params}
    if len(own_dtypes) != 1:
        raise TypeError(
            f"zero3: unit {name!r} mixes parameter dtypes {sorted(map(str, own_dtypes))}; convert the model "
            "to one dtype before training (the `precision` flag does this for you)."
        )
    return own_dtypes.pop()


class FlatGroup:
    """Parameters that are gathered, released and reduced together."""

    def __init__(
        self,
        name: str,
        named_params: list[tuple[str, nn.Parameter]],
        comm: Communicator,
        ledger: ByteLedger,
        pool: BufferPool,
        device: torch.device,
        persistent: bool = False,
        sync_from_rank0: bool = True,
        dtypes: DtypePolicy = DtypePolicy(),
        materializer: Optional["Materializer"] = None,
        offload: Optional["Offload"] = None,
        loaded: Collection[int] = (),
        stays_gathered: bool = False,
    ) -> None:
        """``loaded``: ids of parameters whose values will be read from a checkpoint once every group is
        built (see [Note: loading straight into shards] in engine/layout/sources.py). ``stays_gathered``: one process
        with nothing to shard, see [Note: one process keeps its units gathered]."""
        self.name = name
        self.comm = comm
        self.ledger = ledger
        self.pool = pool  # staging buffers: coalesced gathers, compute-dtype sources, full-weight exports
        self.persistent = persistent
        self.stays_gathered = stays_gathered
        self.dtype = _one_dtype(name, named_params)  # the master dtype
        self.compute_dtype = dtypes.compute or self.dtype
        self.reduce_dtype = dtypes.reduce or self.dtype
        total = sum(p.numel() for _, p in named_params)
        self.shard_numel = -(-total // comm.world_size)  # ceil division
        self.numel = total
        self.trainable = any(p.requires_grad for _, p in named_params)
        self._allocate_shards(offload, device)
        self._build_full(named_params, device, materializer, sync_from_rank0, loaded)
        self.store: Optional["GroupStore"] = offload.new_store(self.shard, self.trainable) if offload is not None else None
        aliased = self._alias_shard_and_full(offload, device)
        self._make_slots(named_params)
        self._start_gathered()
        if offload is not None and self.store is not None:
            self._bind_store(offload, aliased)

    # -- construction, step by step (in the order ``__init__`` runs them) ----------------------------------

    def _allocate_shards(self, offload: Optional["Offload"], device: torch.device) -> None:
        """This rank's master shard (unless the master is the full buffer) and gradient shard."""
        # one process, its master in the compute dtype: the master (the shard) is the full buffer (set in
        # _build_full); not so under offload, whose master lives in its tier
        self.master_is_full = self.stays_gathered and offload is None and self.compute_dtype == self.dtype
        if not self.master_is_full:
            # small pages unless offload refills it from its tier at every gather: [Note: shards are in small pages]
            self.shard = releasable_buffer(self.shard_numel, self.dtype, device, huge=offload is not None)
            self.ledger.add(PARAM_SHARDS, self._nbytes(self.shard))
        # under offload the gradient shard lives with the master, in the store
        self.grad_shard = new_buffer(self.shard_numel, self.dtype, device) if self.trainable and not offload else None
        if self.grad_shard is not None:
            self.ledger.add(GRAD_SHARDS, self._nbytes(self.grad_shard))

    def _build_full(self, named_params: list[tuple[str, nn.Parameter]], device: torch.device,
                    materializer: Optional["Materializer"], sync_from_rank0: bool, loaded: Collection[int]) -> None:  # fmt: skip
        """The full buffer, filled (initialised from the meta device, or the parameters' values, the same
        on every rank) and cut into this rank's shard; it stays gathered."""
        # every value comes from a checkpoint: nothing to initialise, broadcast or copy (the shard is read
        # into once every group is built), and the full buffer is released untouched
        from_checkpoint = all(id(p) in loaded for _, p in named_params)
        with torch.no_grad():
            # One buffer of the full (padded) size is alive per group while it is built; it becomes ``full``
            # when the compute dtype is the master dtype, so building a unit costs one unit's bytes.
            master = releasable_buffer(self.shard_numel * self.comm.world_size, self.dtype, device)
            self.ledger.add(self._full_category, self._nbytes(master))
            if materializer is not None and any(p.is_meta for _, p in named_params):
                # built straight from the meta device: see [Note: sharded initialisation] in engine/layout/materialize.py
                materializer.fill(named_params, master[: self.numel])
                sync_from_rank0 = True  # rank 0 initialised it
            elif not from_checkpoint:
                offset = 0
                for _, p in named_params:
                    master[offset : offset + p.numel()].copy_(p.detach().reshape(-1))
                    offset += p.numel()
            if sync_from_rank0 and not from_checkpoint:
                self.comm.broadcast(master, src=0)
            start = self.comm.rank * self.shard_numel
            if self.master_is_full:
                self.shard = master
            elif not from_checkpoint:
                self.shard.copy_(master[start : start + self.shard_numel])
            if self.compute_dtype == self.dtype:
                self.full = master
            else:
                self.full = releasable_buffer(master.numel(), self.compute_dtype, device)
                self.ledger.add(self._full_category, self._nbytes(self.full))
                if not from_checkpoint:
                    self.full.copy_(master)
                self.ledger.remove(self._full_category, self._nbytes(master))
            del master

    def _make_slots(self, named_params: list[tuple[str, nn.Parameter]]) -> None:
        """Each parameter: a view of ``full`` for the model, its range of the shard for the optimizer."""
        start = self.comm.rank * self.shard_numel
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
        self._set_slot_views()

    def _start_gathered(self) -> None:
        """The live state of a group just built: gathered, no gradients landed, no gather in flight."""
        self.gathered = True
        self.gathers = 0  # all-gathers issued into ``full`` (for tests and the residency profile)
        self.landing: Optional[torch.Tensor] = None  # where this backward's gradients land (land_gradients)
        # per trainable slot, whether its ``.grad`` is a view of ``landing``; the landing buffer's version
        # counter when they were set (see [Note: which parameters received a gradient] in engine/grads/arrivals.py)
        self.landed: list[bool] = []
        self.landed_version = 0
        self.pending: Optional[Then] = None  # an all-gather in flight into ``full`` (see gather.py)
        # agrees with every rank on each all-gather before it is issued (set by the engine; see comm/agreement.py)
        self.check: Optional["OrderCheck"] = None
        # how its all-gathers travel, set by the engine (see [Note: gather routes] in engine/shard/gather.py)
        self.quantized = False  # int8 blocks on the primary route
        self.secondary: Optional["SecondaryShard"] = None  # node-local copy for backward (secondary.py)
        self.source: Optional["ParamSource"] = None

    def _bind_store(self, offload: "Offload", aliased: bool) -> None:
        """Offloaded: the store holds each trainable slot's range, and the source feeds the all-gathers."""
        from ..offload import ShardView

        self.store.bind([ShardView(s.shard_param, s.lo, s.hi, s.param.requires_grad) for s in self.slots])
        self.source = offload.new_source(self.store, self.shard, aliased)

    def _alias_shard_and_full(self, offload: Optional["Offload"], device: torch.device) -> bool:
        """One process, parameters offloaded, on the host: the "all-gather" is a copy of the shard into
        ``full``, which has the same size. The shard then *is* ``full``: parameters are read from their tier
        straight into the buffer the model computes with, with no copy and no second buffer to fault in
        (single-process streaming inference reads every cold unit for every call)."""
        if (
            offload is None or offload.param_tier is None or self.comm.world_size != 1 or self.persistent
            or self.compute_dtype != self.dtype or device.type != "cpu"
        ):  # fmt: skip
            return False
        self.ledger.remove(PARAM_SHARDS, self._nbytes(self.shard))
        self.shard = self.full
        return True

    @property
    def kept_whole(self) -> bool:
        """Never released: gathered from its build to teardown (persistent, or a process alone), so it has no
        secondary shard and its gathers are never quantized."""
        return self.persistent or self.stays_gathered

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
        issue([self])

    def gather_input(self) -> torch.Tensor:
        """The device shard, valid for an all-gather (under offload: refilled from its tier)."""
        return self.shard if self.source is None else self.source.fill()

    def prefetch_input(self) -> None:
        """Start reading the parameter shard from its tier ahead of use (NVMe parameters); not needed
        while the next gather reads the secondary shard."""
        if self.source is not None and route_of(self).over == "job":
            self.source.prefetch()

    def read_in_flight_alone(self) -> bool:
        """One process with its parameters on NVMe: this unit's shard is still being read from the disk
        (see [Note: gathers ahead do not wait for the disk])."""
        return self.source is not None and self.source.aliased and self.source.still_reading()

    def after_gather(self) -> None:
        """An all-gather read the device shard: under offload it may go back to its tier."""
        if self.source is not None:
            self.source.after_gather()

    def begin_fill(self) -> None:
        """Give ``full`` its memory back before a gather writes into it."""
        if not self.gathered:
            reclaim(self.full)
            self.ledger.add(self._full_category, self._nbytes(self.full))

    def gather(self, force: bool = False) -> None:
        """Make the full parameters valid (waiting for a prefetch in flight). ``force`` re-gathers even
        when gathered (the shards changed)."""
        if self.pending is None:
            if self.gathered and (not force or self.master_is_full):  # the master is what the model computes with
                return
            self.start_gather(force)
        self.pending.issue()  # a gather agreed on ahead is issued now (see [Note: checks run a unit ahead])
        self.pending.wait()
        self.pending = None
        self.after_gather()
        mark_gathered(self._classes)
        self.gathered = True

    def _agree(self, groups: Sequence["FlatGroup"]) -> None:
        if self.check is not None:
            self.check.check(groups)

    def master_for_reading(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """This rank's master shard, readable (for exports and checkpoints): ``(tensor, pooled)``, where
        ``pooled`` is a host buffer the caller gives back to ``offload.host`` (NVMe, not resident)."""
        if self.store is None:
            return self.shard, None
        if self.store.master is not None:
            return self.store.master, None
        from ..offload.store import MASTER

        future, buffer = self.store.read_file(MASTER)
        self.store.offload.io.wait(future)
        return buffer, buffer

    @contextmanager
    def gathered_master(self) -> Iterator[torch.Tensor]:
        """The full parameters in the master dtype, in a staging buffer for the duration of the block
        (a collective: all ranks; reads this rank's master from its tier without making it resident)."""
        master, pooled = self.master_for_reading()
        flat = self.pool.take(self.full.numel(), self.dtype, self.shard.device)
        try:
            self._agree([self])
            with torch.no_grad():
                self.comm.all_gather(flat, master.to(self.shard.device))
            if pooled is not None:
                self.store.offload.host.give(pooled)
                pooled = None
            yield flat
        finally:
            if pooled is not None:
                self.store.offload.host.give(pooled)
            self.pool.give(flat)

    def load_piece(self, slot: ParamSlot, source: "TensorSource") -> None:
        """Set this rank's piece of ``slot``'s parameter from ``source``, read by element range (see
        [Note: loading straight into shards] in engine/layout/sources.py); a persistent parameter's full copy is read
        whole. Not a collective: a gathered unit is stale until gathered again."""
        if source.shape.numel() != slot.numel:
            raise ValueError(
                f"zero3: {source.label} has {source.shape.numel()} elements, the parameter {slot.name} "
                f"{tuple(slot.param.shape)} has {slot.numel}; it was written for another model."
            )
        start = slot.piece_start(self.comm.rank, self.shard_numel)
        count = slot.hi - slot.lo
        on_disk = self.store is not None and self.store.master is None
        with torch.no_grad():
            if self.persistent:
                whole = torch.empty(slot.numel, dtype=self.dtype, device=self.shard.device)
                source.read(0, whole)
                self.full[slot.offset : slot.offset + slot.numel].copy_(whole)
                piece = whole[start : start + count]
                if on_disk:
                    self.store.write_master_range(slot.lo, slot.hi, piece)
                else:
                    self.master[slot.lo : slot.hi].copy_(piece)
            elif on_disk:  # on NVMe: straight into the swap file
                piece = torch.empty(count, dtype=self.dtype, device=self.shard.device)
                source.read(start, piece)
                self.store.write_master_range(slot.lo, slot.hi, piece)
            else:
                source.read(start, self.master[slot.lo : slot.hi])

    def release(self) -> None:
        """Free the full parameters (persistent groups, and those of a process alone, are never released).

        [Note: one process keeps its units gathered]
        With one rank the "shard" is the whole flat group, so releasing a unit after its forward and
        gathering it again for its backward only copies the shard into a buffer of the same size and faults
        that buffer's pages in again, twice a step per unit. Unless ``single_process_sharding`` asks for it
        (or parameters are offloaded: they are read from their tier per use), such a group is built
        ``stays_gathered``: never released, and in the master dtype the shard *is* the full buffer, so the
        optimizer steps the very tensor the model computes with, and the re-gather after a step (of groups
        gathered at that moment) finds the output to be its input and copies nothing. In a lower compute
        dtype the full copy stays too and is cast from the master once per step. Hooks, gradients and the
        optimizer run as with several ranks, so nothing else tells one process apart."""
        if self.kept_whole:
            return
        if self.pending is not None:
            self.gather()  # a buffer may not be freed under a collective still writing into it
        if not self.gathered:
            return
        if self.secondary is not None and self.secondary.wanted:
            self.secondary.keep(self.full)  # [Note: secondary shards] in secondary.py
        mark_released(self._classes)
        self.ledger.remove(self._full_category, self._nbytes(self.full))
        release(self.full, self.ledger)  # parked for the next gather: see [Note: released pages are parked]
        self.gathered = False

    def write_back(self, src: int | None = None) -> None:
        """Copy the (gathered, possibly modified) full parameters into this rank's shard.

        With ``src`` set, that rank's full parameters are broadcast first, so all ranks agree. Under a
        lower compute dtype the shard receives the gathered (rounded) values.
        """
        assert self.gathered, "write_back needs the group gathered"
        self.drop_secondary()  # the shards change
        with torch.no_grad():
            if src is not None:
                self.comm.broadcast(self.full, src=src)
            start = self.comm.rank * self.shard_numel
            master = self.master if self.store is None else self.store.require_resident("writing weights back")
            master.copy_(self.full[start : start + self.shard_numel])

    def keep_secondary_on_release(self) -> None:
        """Its backward will gather it again: keep its secondary shard when it is released (if it has one)."""
        if self.secondary is not None:
            self.secondary.wanted = True

    def drop_secondary(self) -> None:
        """Its backward is over, or its shards change: the secondary shard goes (if it has one)."""
        if self.secondary is not None:
            self.secondary.drop()

    def unshard(self) -> None:
        """Turn the parameters back into ordinary, independent full tensors in the master dtype (at teardown)."""
        self.drop_secondary()
        with self.gathered_master() as master:
            mark_gathered(self._classes)
            for slot in self.slots:
                slot.param.data = master[slot.offset : slot.offset + slot.numel].view(slot.param.shape).clone()
        if self.gathered:
            release(self.full)
            self.ledger.remove(self._full_category, self._nbytes(self.full))
        if (self.source is None or self.source.filled) and not self.master_is_full:
            self.ledger.remove(PARAM_SHARDS, self._nbytes(self.shard))
        if self.grad_shard is not None:
            self.ledger.remove(GRAD_SHARDS, self._nbytes(self.grad_shard))
        self.gathered = False
        self.slots = []
        self._set_slot_views()

    # -- [Note: gradients land in a pooled buffer] --------------------------------------------------

    def land_gradients(self) -> None:
        """Before the unit's backward: give each trainable parameter without a gradient a zeroed view of a
        pooled buffer as ``.grad``, so that autograd accumulates into it in place.

        [Note: gradients land in a pooled buffer]
        Left alone, autograd allocates every parameter's full gradient on its own, unit after unit, and
        the gradient is dropped as soon as it is packed for the reduce-scatter. On the host those multi-MB
        tensors come from glibc's heap, and the small allocations made in between carve up the holes they
        leave, so the heap (and the resident set) grows by about a unit per unit through backward. A gradient that already exists is accumulated into in place, so a
        zeroed view of a pooled buffer, set before the unit's backward starts, receives the gradient with
        no allocation; the buffer is then what the reduce-scatter sends (see [Note: the landing buffer is
        sent] in engine/grads/reduction.py), back to the pool once it has been sent. A landing view exists whether or not
        autograd wrote into it: which parameters really received a gradient is told by the buffer's
        version counter ([Note: which parameters received a gradient] in engine/grads/arrivals.py)."""
        if self.landing is not None or not self.trainable:
            return
        self.landing = self.pool.take(self.full.numel(), self.compute_dtype, self.full.device, zero=True)
        # every parameter's view in one call (the slots lie side by side from offset 0)
        views = torch._utils._unflatten_dense_tensors(self.landing[: self.numel], self.params)
        landed = []
        for index in self._trainable_index:
            param, view = self.slots[index].param, views[index]
            sets = param.grad is None and param.dtype == view.dtype
            if sets:
                param.grad = view
            landed.append(sets)
        self.landed, self.landed_version = landed, self.landing._version

    def gradients_packed(self) -> None:
        """The gradients were copied out: drop them and give the landing buffer back."""
        with engine_access():  # the unit is released by now
            for slot in self.trainable_slots:
                slot.param.grad = None
        if self.landing is not None:
            self.pool.give(self.landing)
            self.landing = None

    # -- views ------------------------------------------------------------------------------------

    @property
    def params(self) -> list[nn.Parameter]:
        return [slot.param for slot in self.slots]

    def _set_slot_views(self) -> None:
        """What the hot path reads per unit instead of asking each parameter again: the trainable slots
        (``requires_grad`` is fixed once training starts, see docs/troubleshooting.md, "Known differences from DDP"; asking
        a released parameter is a Python ``__torch_function__`` call) and the class of each parameter."""
        self._trainable_index = [i for i, slot in enumerate(self.slots) if slot.param.requires_grad]
        self.trainable_slots: list[ParamSlot] = [self.slots[i] for i in self._trainable_index]
        self._trainable_set = frozenset(self._trainable_index)
        self._classes = [(slot.param, slot.original_class) for slot in self.slots]
        # the trainable parameters with a piece on this rank, and each piece's view of the gradient shard:
        # see [Note: the gradient shard in one pass] in engine/grads/reduction.py
        self.local_trainable_slots = [slot for slot in self.trainable_slots if slot.hi > slot.lo]
        shard = self.grad_shard
        self.grad_views = [] if shard is None else [shard[s.lo : s.hi] for s in self.local_trainable_slots]

    def requires_grad_changed(self) -> list[str]:
        """The parameters whose ``requires_grad`` is no longer what this group was built with.

        [Note: the trainable set is fixed at setup]
        Which parameters train decides how a unit is laid out (rule 4 in layout/units.py), which have a gradient
        shard, which the optimizer steps and which hooks count gradients; all of it is built once. A
        parameter unfrozen later would get an ordinary ``.grad`` that nothing reduces or steps (and that
        nothing frees); one frozen later would still be stepped with a zero gradient. So the engine asks
        after every backward (one attribute per parameter) and fails naming them instead of training on
        silently without them."""
        with engine_access():  # released parameters: plain attribute reads
            return [slot.name for index, slot in enumerate(self.slots)
                    if slot.param.requires_grad != (index in self._trainable_set)]  # fmt: skip

    def late_gradient(self) -> Optional[nn.Parameter]:
        """A trainable parameter with a ``.grad`` after this group's gradients were packed, if any
        (see [Note: counting a unit's gradients] in engine/schedule/hooks.py)."""
        with engine_access():  # released parameters: plain attribute reads
            return next((slot.param for slot in self.trainable_slots if slot.param.grad is not None), None)
