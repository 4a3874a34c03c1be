"""Gradient reduction: full gradients of a group -> this rank's gradient shard, in one order on every rank.

After a group's backward, each rank holds full gradients (``param.grad``) computed from its own
micro-batch. ``pack_gradients`` packs them into one buffer and divides by the world size (so the result
is the mean over ranks, as DDP computes it); ``reduce_packed`` reduce-scatters one group, or a bucket of
small groups in one collective, and adds this rank's slice into the shard parameters' ``.grad``. The
full gradients are dropped right away. Gradients travel in the group's reduce dtype and are accumulated
in the master dtype. ``ReductionQueue`` decides when each group goes.

Accumulation follows torch's own rule, per shard parameter: if its ``.grad`` is None (the optimizer's
``zero_grad`` ran) the reduced slice becomes the gradient, otherwise it is added. So
``accumulate_grad_batches`` reduces every micro-batch (memory stays at 1/N) and sums in the shard.

[Note: which parameters had a gradient]
DDP with ``find_unused_parameters=True`` leaves ``.grad`` alone (None after ``zero_grad``) for a
parameter that no rank used, and gives a parameter that some ranks used the mean over all ranks, zeros
counting for the others. To do the same, each rank tells which trainable parameters got a gradient
here (``Packed.used_here``, see [Note: which parameters received a gradient] in arrivals.py); a
parameter without one sends zeros. When backward ends, the ranks tell
each other on the check group (host integers, no device synchronisation) whether any of them lacked a
gradient, and only then exchange the flags of every unit reduced (``restore_unused``): a shard gradient
that this backward created for a parameter no rank used is set back to None. The flags do not travel
in each unit's reduce-scatter: extra columns there would keep the send buffer from being the buffer the
gradients land in (see [Note: the landing buffer is sent]).

[Note: reduction order]
The n-th reduce-scatter of every rank must reduce the same groups, or gradients of one unit are summed
into another's (equal sizes) or the collective fails (different sizes). Hooks fire in an order that
depends on the rank's data (a parameter used on one rank only, a unit whose backward ends earlier), so
reduce-scatters are not issued in arrival order but by a queue whose order every rank derives alike:
the recorded backward trace (each unit at its last appearance; traces are compared across ranks when
recorded), else reverse module order; trainable units missing from the trace after those, then the root
and the persistent group. A unit is issued when its backward is over *and* every unit before it has
been issued; every trainable unit is issued in every backward (with zero flags where nothing arrived),
so the sequence of reduce-scatters is the same on every rank by construction. Consecutive small units
share a bucket, flushed before the next large unit. Everything left is issued and completed when
backward ends.

Waiting for a reduce-scatter during backward (``MAX_INFLIGHT_REDUCES`` in flight, or
``overlap_comm=False``) blocks this rank until every peer has issued it, that is, until the unit's
backward is over there too. That is safe when the unit has a post-backward signal
(``UnitRuntime.ends_alike``): every rank reaches that point of backward, needing nothing from this rank
that it has not issued already. A unit without one (no input needs gradients) whose parameters got no
gradient on some rank ends there only when backward ends, after gathers that this rank, blocked, would
never issue. So such a reduce-scatter is not waited for during backward: the next unit waits its turn
instead (its full gradients stay alive meanwhile), and under ``overlap_comm=False`` the unit is reduced
when backward ends.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Callable, NamedTuple, Optional

import torch

from ..comm.communicator import Communicator
from ..comm.records import Pending
from ..layout.released import engine_access
from ..memory.buffers import BufferPool
from ..shard.flat_group import FlatGroup
from .arrivals import received_gradients

if TYPE_CHECKING:
    from ..shard.runtime import UnitRuntime

MAX_INFLIGHT_REDUCES = 2


class Packed(NamedTuple):
    """One group's gradients ready to reduce: ``buffer`` is (world, shard_numel), row r the slice rank r
    receives, in the group's padded full layout; in the reduce dtype, or with one rank in the compute
    dtype ([Note: one rank accumulates its landing buffer])."""

    group: FlatGroup
    buffer: torch.Tensor
    used_here: list[bool]  # per trainable slot: this rank had a gradient for it
    ends_alike: bool  # its unit's backward ends at the same point on every rank (UnitRuntime.ends_alike)
    divide_after: bool  # the sum is divided by the world size after the reduce-scatter (divides_exactly_after)
    created: list  # trainable slots whose shard ``.grad`` this reduction created (filled by _accumulate)

    @property
    def width(self) -> int:
        return self.buffer.shape[1]


def divides_exactly_after(world: int, dtype: torch.dtype) -> bool:
    """Whether dividing the reduced sum by ``world`` gives the very bits of summing gradients divided
    first (as DDP does): so it does when ``world`` is a power of two and the dtype has fp32's exponent
    range, since scaling by a power of two is exact there and commutes with every rounding of the sum
    (an fp16 sum could overflow where the divided one does not). Dividing the 1/world slice instead of
    the whole unit takes a pass over unit-sized buffers off every backward."""
    return world & (world - 1) == 0 and dtype in (torch.float32, torch.float64, torch.bfloat16)


def _new_buffer(pool: BufferPool, world: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Where a packed gradient buffer comes from when it is not the landing buffer: the engine's staging
    pool, given back once the reduce-scatter that reads it has completed (see [Note: reused staging
    buffers] in engine/memory/buffers.py). Not zeroed: its users write every element (see [Note: packing writes every
    element once])."""
    return pool.take(world * width, dtype, device).view(world, width)


def pack_gradients(group: FlatGroup, comm: Communicator, ends_alike: bool = True) -> Optional[Packed]:
    """The group's full gradients packed for ``reduce_packed`` (divided by the world size, unless the
    reduced slice is: ``divides_exactly_after``); the parameters' own ``.grad`` are freed. None when the
    group has nothing trainable.

    [Note: the landing buffer is sent]
    The gradients of a unit land in one zeroed buffer in the padded full layout (see [Note: gradients
    land in a pooled buffer] in engine/shard/flat_group.py), which is the layout the reduce-scatter reads. So when the
    reduce dtype is the compute dtype (or there is one rank: [Note: one rank accumulates its landing
    buffer]), that buffer itself is sent: no copy of the unit, and no division
    either where it is exact after the sum. Only a gradient that autograd did not leave in its landing
    view (another dtype, a replaced ``.grad``) is copied into place.

    [Note: packing writes every element once]
    Otherwise (another reduce dtype, no landing buffer) the gradients are copied into a staging buffer
    that is not zeroed first: each gradient is divided as it is copied (where the division is not left
    for after the sum), and only what no gradient covers is zeroed: frozen parameters, parameters
    without a gradient, the padding."""
    if not group.trainable:
        return None
    world, width = comm.world_size, group.shard_numel
    divide_after = divides_exactly_after(world, group.reduce_dtype)
    landing = group.landing
    with engine_access():  # the unit is released by now: its parameters' ``.grad`` read in bulk
        used = received_gradients(group)
        strays = None if landing is None else _strays_if_sent(group, landing, world, used)
        if strays is not None:  # the landing buffer is sent
            group.landing = None  # the reduction owns it now
            for slot, grad in strays:
                landing[slot.offset : slot.offset + slot.numel].copy_(grad.detach().reshape(-1))
            if not divide_after and world > 1:
                landing.div_(world)
            buffer = landing.view(world, width)
        else:
            buffer = _new_buffer(group.pool, world, width, group.reduce_dtype, group.shard.device)
            _pack_copies(buffer, group, used, 1 if divide_after else world)
    group.gradients_packed()
    return Packed(group, buffer, used, ends_alike, divide_after, [])


def _strays(group: FlatGroup, landing: torch.Tensor, used: list[bool]) -> list:
    """``(slot, grad)`` for each gradient that autograd did not leave in its landing view (another dtype, a
    ``.grad`` replaced by the user or set before the landing buffer was)."""
    base, size = landing.data_ptr(), landing.element_size()
    strays = []
    for slot, had in zip(group.trainable_slots, used):
        grad = slot.param.grad
        if had and grad is not None and grad.data_ptr() != base + slot.offset * size:
            strays.append((slot, grad))
    return strays


def _strays_if_sent(group: FlatGroup, landing: torch.Tensor, world: int, used: list[bool]) -> Optional[list]:
    """The stray gradients to copy into the landing buffer if the buffer itself is what ``reduce_packed``
    gets ([Note: the landing buffer is sent]); None if it is not (the gradients are then packed by copies,
    and nothing is looked for parameter by parameter first).

    [Note: one rank accumulates its landing buffer]
    With one rank nothing travels, so the reduce dtype is only a step between the compute dtype the
    gradients land in and the master dtype of the gradient shard. Where it differs from the compute
    dtype it is fp32 (the only other choice), and the compute dtype is bf16 or fp16, which convert to
    fp32 exactly, as they do to the fp32 master. So the landing buffer (bf16 under ``bf16-mixed``) is
    accumulated into the gradient shard as it is, one cast in one pass, giving the very values of
    converting it to the reduce dtype first: that conversion was a copy per parameter (a kernel each
    on a GPU) into a staging buffer, then a second pass over the unit.
    A stray gradient would be rounded into the landing dtype, so with one the copies stay; with the
    optimizer offloaded they stay too (the host store's copies are written for the reduce dtype and
    were left as they are)."""
    if landing.dtype == group.reduce_dtype:
        return _strays(group, landing, used)
    if world == 1 and group.store is None:
        return None if _strays(group, landing, used) else []
    return None


def _pack_copies(buffer: torch.Tensor, group: FlatGroup, used: list[bool], divisor: int) -> None:
    """Write every element of ``buffer`` once: the gradients (divided by ``divisor``), zeros elsewhere."""
    written = set()
    for slot, had in zip(group.trainable_slots, used):
        grad = slot.param.grad
        if had and grad is not None:
            _copy_rows(buffer, slot.offset, grad.detach().reshape(-1), divisor)
            written.add(id(slot))
    for slot in group.slots:
        if id(slot) not in written:
            _zero_rows(buffer, slot.offset, slot.numel)
    world, width = buffer.shape
    _zero_rows(buffer, group.numel, world * width - group.numel)  # the padding


def _row_pieces(rows: torch.Tensor, offset: int, numel: int) -> list:
    """``(row view, start in the flat range, count)`` for the ``numel`` elements at ``offset`` of the padded
    full layout, which ``rows`` (world, S) holds row by row."""
    width = rows.shape[1]
    row, col = divmod(offset, width)
    if col + numel <= width:  # within one row: most parameters
        return [(rows[row, col : col + numel], 0, numel)] if numel else []
    pieces, done = [], 0
    while done < numel:
        row, col = divmod(offset + done, width)
        n = min(width - col, numel - done)
        pieces.append((rows[row, col : col + n], done, n))
        done += n
    return pieces


def _copy_rows(rows: torch.Tensor, offset: int, flat: torch.Tensor, divisor: int = 1) -> None:
    """Write ``flat / divisor`` at ``offset`` of the padded full layout (divided in the rows' dtype)."""
    for piece, start, n in _row_pieces(rows, offset, flat.numel()):
        source = flat[start : start + n]
        if divisor == 1:
            piece.copy_(source)
        elif source.dtype == piece.dtype:
            torch.div(source, divisor, out=piece)
        else:  # converted first, then divided in the reduce dtype, as a copy and a division would
            piece.copy_(source)
            piece.div_(divisor)


def _zero_rows(rows: torch.Tensor, offset: int, numel: int) -> None:
    for piece, _, _ in _row_pieces(rows, offset, numel):
        piece.zero_()


def reduce_packed(packed: list[Packed], comm: Communicator, async_op: bool = False) -> Optional["_Accumulation"]:
    """One reduce-scatter for the packed gradients of one or more groups (a bucket).

    [Note: coalesced reduce-scatter]
    A reduce-scatter hands rank r the r-th contiguous slice of its input. Each packed buffer is laid out
    row by row (row r: what rank r receives); several groups go side by side, ``[g1 row 0 | g2 row 0 | ...
    | g1 row 1 | g2 row 1 | ...]``, so rank r receives ``[g1 row r | g2 row r | ...]``.

    [Note: one rank reduces nothing]
    With one rank a packed buffer has one row, and that row is already the sum over ranks. Copying it
    into a "reduced" buffer (after concatenating a bucket's buffers) would be a pass over the unit's
    gradients per backward, two for a bucket, that changes no value. So the row itself is accumulated
    into the gradient shard at once (there is nothing to overlap with), and each buffer goes back to the
    pool once that has read it, ready for the next unit's gradients. No collective is issued, so the
    communication figures count no reduce-scatter at world size 1.
    """
    first, pool = packed[0].buffer, packed[0].group.pool
    if comm.world_size == 1:
        rows = [item.buffer.view(-1) for item in packed]
        return _Accumulation(None, list(zip(packed, rows)), [], rows).finish(async_op=False)
    if len(packed) == 1:
        send = first
    else:
        send = _new_buffer(pool, comm.world_size, sum(p.width for p in packed), first.dtype, first.device)
        torch.cat([p.buffer for p in packed], dim=1, out=send)
        for item in packed:
            pool.give(item.buffer.view(-1))
    reduced = pool.take(send.shape[1], first.dtype, first.device)
    pending = comm.reduce_scatter(reduced, send.view(-1), async_op=True)
    assert pending is not None
    results, start = [], 0
    for item in packed:
        results.append((item, reduced[start : start + item.width]))
        start += item.width
    return _Accumulation(pending, results, [send.view(-1)], [reduced]).finish(async_op)


class _Accumulation:
    """A reduce-scatter in flight (``pending``; None where there is nothing to wait for: [Note: one rank
    reduces nothing]) and what to do with its result: add each group's slice into its shard gradients.
    ``keep`` holds the buffers the collective reads until it completes; ``reduced``, the buffers the
    slices are views of, given back once every slice has been read."""

    def __init__(self, pending: Optional[Pending], results: list[tuple[Packed, torch.Tensor]], keep: list,
                 reduced: list[torch.Tensor]) -> None:  # fmt: skip
        self.pending, self.results, self.keep, self.reduced = pending, results, keep, reduced
        self.done = False

    def finish(self, async_op: bool) -> Optional["_Accumulation"]:
        if async_op:
            return self
        self.wait()
        return None

    def ready(self) -> bool:
        return self.done or self.pending is None or self.pending.ready()

    @property
    def ends_alike(self) -> bool:
        return all(item.ends_alike for item, _ in self.results)

    def wait(self) -> None:
        if self.done:
            return
        if self.pending is not None:
            self.pending.wait()
        pool = self.results[0][0].group.pool
        for buffer in self.keep:
            pool.give(buffer)
        # ``reduced`` goes back once every copy reading it (to an offload tier) has completed
        readers = [len(self.results)]

        def read() -> None:
            readers[0] -= 1
            if readers[0] == 0:
                for buffer in self.reduced:
                    pool.give(buffer)

        for item, reduced in self.results:
            _accumulate(item, reduced, read)
        self.results, self.keep = [], []
        self.done = True


def _accumulate(item: Packed, reduced: torch.Tensor, read: Callable[[], None] = lambda: None) -> None:
    """Add ``reduced`` into the group's gradient shard; ``read()`` once nothing reads ``reduced`` any more."""
    group = item.group
    grads = reduced[: group.shard_numel]
    if group.store is not None:  # offload: the gradient shard lives with the master (see docs/troubleshooting.md, DDP differences)
        if item.divide_after:
            grads.div_(group.comm.world_size)
        group.store.accumulate(grads, read)
        return
    _accumulate_on_device(item, grads)
    read()


def _accumulate_on_device(item: Packed, grads: torch.Tensor) -> None:
    """Torch's accumulation rule per shard parameter (see the top of this file), in one pass over the unit
    where it can: [Note: the gradient shard in one pass]."""
    group = item.group
    divisor = group.comm.world_size if item.divide_after else 1
    if _accumulate_whole(item, grads, divisor):
        return
    for slot in group.trainable_slots:
        if slot.hi == slot.lo:
            continue  # nothing of it here
        piece = grads[slot.lo : slot.hi]
        shard_param = slot.shard_param
        if shard_param.grad is None:
            view = group.grad_shard[slot.lo : slot.hi]
            if divisor == 1:
                view.copy_(piece)
            else:
                torch.div(piece, divisor, out=view)
            shard_param.grad = view
            item.created.append(slot)
        elif divisor == 1:
            shard_param.grad.add_(piece)
        else:  # piece / divisor is exact (a power of two), so the sum rounds as the divided one would
            shard_param.grad.add_(piece, alpha=1.0 / divisor)


def _accumulate_whole(item: Packed, grads: torch.Tensor, divisor: int) -> bool:
    """[Note: the gradient shard in one pass]
    Per parameter, accumulating the reduced slice is a kernel (and a few Python calls) for each
    parameter's piece: on a GPU the launches are the cost, on tiny layers the calls are. In the two
    common cases the pieces are the whole gradient shard: every shard ``.grad`` is None (the optimizer's
    ``zero_grad`` ran), so the slice is written into the gradient shard at once and each ``.grad`` becomes
    its view of it; or every ``.grad`` is still that view (accumulating micro-batches), so the slice is
    added at once. Elements of frozen parameters, of parameters without a gradient and the padding are
    zeros in ``grads`` (see ``pack_gradients``): writing or adding them changes no gradient. Anything
    else (a ``.grad`` replaced by the user, one restored to None for a parameter no rank used) goes
    parameter by parameter. False when it did not apply."""
    group = item.group
    slots, views = group.local_trainable_slots, group.grad_views
    if not slots or group.grad_shard is None:
        return False
    current = [slot.shard_param.grad for slot in slots]
    if all(grad is None for grad in current):
        if divisor == 1:
            group.grad_shard.copy_(grads)
        else:
            torch.div(grads, divisor, out=group.grad_shard)
        for slot, view in zip(slots, views):
            slot.shard_param.grad = view
        item.created.extend(slots)
        return True
    if all(grad is view for grad, view in zip(current, views)):
        group.grad_shard.add_(grads, alpha=1.0 / divisor)  # exact for a power-of-two divisor, as below
        return True
    return False


def restore_unused(reduced: list[Packed], comm: Communicator) -> None:
    """[Note: which parameters had a gradient]: a shard ``.grad`` that this backward created for a
    parameter that no rank used goes back to None. Host-side checks on the check group (no device
    synchronisation), the same on every rank: first whether any rank lacked a gradient at all (one
    integer each); only then every rank's flags, one per trainable parameter of the groups reduced."""
    used = [flag for item in reduced for flag in item.used_here]
    if all(row[0] == 0 for row in comm.agree([0 if all(used) else 1])):
        return
    counts = [sum(column) for column in zip(*comm.agree([int(flag) for flag in used]))]
    start = 0
    for item in reduced:
        slots = item.group.trainable_slots
        unused = {id(slot) for slot, count in zip(slots, counts[start : start + len(slots)]) if count == 0}
        for slot in item.created:
            if id(slot) in unused:
                slot.shard_param.grad = None
        start += len(slots)


class ReductionQueue:
    """Issues the reduce-scatters of one backward pass in the order of [Note: reduction order]."""

    def __init__(
        self,
        units: list["UnitRuntime"],
        root: Optional["UnitRuntime"],
        persistent: Optional["UnitRuntime"],
        comm: Communicator,
        bucket_numel: int,
        overlap: bool,
    ) -> None:
        self.units = [rt for rt in units if rt.trainable]  # in module order
        self.last = [rt for rt in (root, persistent) if rt is not None and rt.trainable]
        self.comm = comm
        self.bucket_numel = bucket_numel
        self.overlap = overlap
        self.order: list["UnitRuntime"] = []
        self._next = 0  # index in ``order`` of the next unit to issue
        self._bucket: list[Packed] = []
        self._inflight: deque[_Accumulation] = deque()
        self._reduced: list[Packed] = []  # every group packed in this backward, in order (restore_unused)
        self.issued = 0  # reduce-scatters issued (for tests and monitors)

    def order_for(self, backward_trace: list["UnitRuntime"]) -> list["UnitRuntime"]:
        """The order of this backward's reductions, from the last recorded backward trace."""
        last_seen = {id(rt): i for i, rt in enumerate(backward_trace)}
        traced = sorted((rt for rt in self.units if id(rt) in last_seen), key=lambda rt: last_seen[id(rt)])
        untraced = [rt for rt in reversed(self.units) if id(rt) not in last_seen]
        return traced + untraced + self.last

    def begin(self, backward_trace: list["UnitRuntime"]) -> None:
        self.order, self._next = self.order_for(backward_trace), 0

    def advance(self, finishing: bool = False) -> None:
        """Issue every unit whose turn has come (its backward over, all before it issued). During backward
        nothing blocks (see [Note: reduction order]); ``finishing`` (backward ended) waits as needed."""
        self._retire()
        while self._next < len(self.order):
            runtime = self.order[self._next]
            if not runtime.backward_over or (not self.overlap and not finishing and not runtime.ends_alike):
                return
            if self.overlap and len(self._inflight) >= MAX_INFLIGHT_REDUCES:
                if not (finishing or self._inflight[0].ends_alike):
                    return  # its turn comes at a later hook, or when backward ends
                self._inflight.popleft().wait()
            self._next += 1
            runtime.mark_reduced()
            packed = pack_gradients(runtime.group, self.comm, runtime.ends_alike)
            assert packed is not None
            self._reduced.append(packed)
            if packed.group.full.numel() >= self.bucket_numel:
                self._flush()
                self._issue([packed])
            else:
                self._bucket.append(packed)
                if sum(p.group.full.numel() for p in self._bucket) >= self.bucket_numel:
                    self._flush()

    def finish(self) -> None:
        """Backward is over: issue what is left, in order, and complete every reduction."""
        self.advance(finishing=True)
        self._flush()
        while self._inflight:
            self._inflight.popleft().wait()
        reduced, self._reduced = self._reduced, []
        restore_unused(reduced, self.comm)
        self.order = []

    @property
    def reducing(self) -> bool:
        """Whether reductions are in flight: while none are, only a unit whose backward has just ended
        can move the queue, and every path that ends one calls ``advance`` itself."""
        return bool(self._inflight)

    def _retire(self) -> None:
        while self._inflight and self._inflight[0].ready():
            self._inflight.popleft().wait()

    def _flush(self) -> None:
        if self._bucket:
            bucket, self._bucket = self._bucket, []
            self._issue(bucket)

    def _issue(self, packed: list[Packed]) -> None:
        self.issued += 1
        accumulation = reduce_packed(packed, self.comm, async_op=self.overlap)
        if accumulation is not None:
            self._inflight.append(accumulation)
