"""Gradient reduction: full gradients of a group -> this rank's gradient shard.

After a group's backward, each rank holds full gradients (``param.grad``) computed from its own
micro-batch. ``reduce_group_gradients`` packs them into one flat buffer, divides by the world size
(so the result is the mean over ranks, as DDP computes it), reduce-scatters, and adds this rank's
slice into the shard parameters' ``.grad``. The full gradients are dropped right away. Gradients
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


def reduce_group_gradients(
    group: FlatGroup, comm: Communicator, async_op: bool = False
) -> Optional["_Accumulation"]:
    """Reduce-scatter the group's full gradients into the shard gradients and free the full ones.

    With ``async_op`` the reduce-scatter is only issued: the returned ``Pending`` adds the result into
    the shard gradients when waited on. The full gradients are free either way.
    """
    if group.grad_shard is None:
        return None
    flat = torch.zeros(group.full.numel(), dtype=group.reduce_dtype, device=group.shard.device)
    for slot in group.trainable_slots:
        grad = slot.param.grad
        if grad is not None:
            flat[slot.offset : slot.offset + slot.numel].copy_(grad.reshape(-1))
            slot.param.grad = None
    if comm.world_size > 1:
        flat.div_(comm.world_size)
    reduced = torch.empty(group.shard_numel, dtype=flat.dtype, device=flat.device)
    pending = comm.reduce_scatter(reduced, flat, async_op=True)
    assert pending is not None
    return _Accumulation(pending, group, reduced, flat).finish(async_op)


class _Accumulation:
    """A reduce-scatter in flight and what to do with its result: add it into the shard gradients."""

    def __init__(self, pending: Pending, group: FlatGroup, reduced: torch.Tensor, flat: torch.Tensor) -> None:
        self.pending, self.group, self.reduced, self.flat = pending, group, reduced, flat
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
        _accumulate(self.group, self.reduced)
        self.reduced = self.flat = None  # type: ignore[assignment]
        self.done = True


def _accumulate(group: FlatGroup, reduced: torch.Tensor) -> None:
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
