"""Gradient reduction: full gradients of a group -> this rank's gradient shard.

After a group's backward, each rank holds full gradients (``param.grad``) computed from its own
micro-batch. ``pack_gradients`` packs them into one flat buffer and divides by the world size (so the
result is the mean over ranks, as DDP computes it); ``reduce_packed`` reduce-scatters one group, or a
bucket of small groups in one collective, and adds this rank's slice into the shard parameters' ``.grad``. The full gradients are dropped right away. Gradients
travel in the group's reduce dtype and are accumulated in the master dtype.

Accumulation follows torch's own rule, per shard parameter: if its ``.grad`` is None (the optimizer's
``zero_grad`` ran) the reduced slice becomes the gradient, otherwise it is added. So
``accumulate_grad_batches`` reduces every micro-batch (memory stays at 1/N) and sums in the shard.
"""

from __future__ import annotations

import torch

from typing import Optional

from .comm import Communicator, Pending
from .shard import FlatGroup


def pack_gradients(group: FlatGroup, comm: Communicator) -> Optional[torch.Tensor]:
    """The group's full gradients as one flat, padded buffer in the reduce dtype, divided by the world
    size; the parameters' own ``.grad`` are freed. None when the group has nothing trainable."""
    if not group.trainable:
        return None
    flat = group.pool.take(group.full.numel(), group.reduce_dtype, group.shard.device, zero=True)
    for slot in group.trainable_slots:
        grad = slot.param.grad
        if grad is not None:
            flat[slot.offset : slot.offset + slot.numel].copy_(grad.reshape(-1))
            slot.param.grad = None
    if comm.world_size > 1:
        flat.div_(comm.world_size)
    return flat


def reduce_packed(
    packed: list[tuple[FlatGroup, torch.Tensor]], comm: Communicator, async_op: bool = False
) -> Optional["_Accumulation"]:
    """One reduce-scatter for the packed gradients of one or more groups (a bucket).

    [Note: coalesced reduce-scatter]
    A reduce-scatter hands rank r the r-th contiguous slice of its input. For several groups at once,
    the input is laid out rank-major, ``[g1 slice 0 | g2 slice 0 | ... | g1 slice 1 | g2 slice 1 | ...]``,
    so rank r receives ``[g1 slice r | g2 slice r | ...]``: each group's shard, side by side.
    """
    pool = packed[0][0].pool  # every buffer here is a staging buffer, back to the pool once done
    if len(packed) == 1:
        group, flat = packed[0]
        reduced = pool.take(group.shard_numel, flat.dtype, flat.device)
        pending = comm.reduce_scatter(reduced, flat, async_op=True)
        assert pending is not None
        return _Accumulation(pending, [(group, reduced)], [flat], reduced).finish(async_op)
    world = comm.world_size
    widths = [group.shard_numel for group, _ in packed]
    first = packed[0][1]
    rank_major = pool.take(world * sum(widths), first.dtype, first.device).view(world, sum(widths))
    offset = 0
    pieces = []
    for (group, flat), width in zip(packed, widths):
        rank_major[:, offset : offset + width].copy_(flat.view(world, width))
        pool.give(flat)
        pieces.append((group, offset, width))
        offset += width
    reduced = pool.take(offset, first.dtype, first.device)
    pending = comm.reduce_scatter(reduced, rank_major.view(-1), async_op=True)
    assert pending is not None
    results = [(group, reduced[start : start + width]) for group, start, width in pieces]
    return _Accumulation(pending, results, [rank_major.view(-1)], reduced).finish(async_op)


class _Accumulation:
    """A reduce-scatter in flight and what to do with its result: add each group's slice into its shard
    gradients. ``keep`` holds the buffers the collective reads until it completes."""

    def __init__(self, pending: Pending, results: list[tuple[FlatGroup, torch.Tensor]], keep: list, reduced: torch.Tensor) -> None:
        self.pending, self.results, self.keep, self.reduced = pending, results, keep, reduced
        self.done = False

    def finish(self, async_op: bool) -> Optional["_Accumulation"]:
        if async_op:
            return self
        self.wait()
        return None

    def wait(self) -> None:
        if self.done:
            return
        self.pending.wait()
        pool = self.results[0][0].pool
        for buffer in self.keep:
            pool.give(buffer)
        # ``reduced`` goes back once every copy reading it (to an offload tier) has completed
        readers = [len(self.results)]

        def read() -> None:
            readers[0] -= 1
            if readers[0] == 0:
                pool.give(self.reduced)

        for group, reduced in self.results:
            _accumulate(group, reduced, read)
        self.results, self.keep = [], []
        self.done = True


def _accumulate(group: FlatGroup, reduced: torch.Tensor, read) -> None:
    """Add ``reduced`` into the group's gradient shard; ``read()`` once nothing reads ``reduced`` any more."""
    if group.store is not None:  # offload: the gradient shard lives with the master
        group.store.accumulate(reduced, read)
        return
    _accumulate_on_device(group, reduced)
    read()


def _accumulate_on_device(group: FlatGroup, reduced: torch.Tensor) -> None:
    for slot in group.trainable_slots:
        if slot.hi == slot.lo:
            continue
        piece = reduced[slot.lo : slot.hi]
        shard_param = slot.shard_param
        if shard_param.grad is None:
            view = group.grad_shard[slot.lo : slot.hi]
            view.copy_(piece)
            shard_param.grad = view
        else:
            shard_param.grad.add_(piece)
