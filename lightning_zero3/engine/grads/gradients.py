"""Reading and changing the shard gradients wherever they live: clipping and fp16 unscaling.

Gradient shards live on the device (no offload), in host memory (``offload_optimizer="cpu"``: copies
from the device may still be in flight, so every reader first waits for them), or in swap files between
backward and the step (``"nvme"``). ``visit_gradients`` hands a function every gradient piece of the
chosen shard parameters: in memory as they are, from NVMe streamed read-only a few groups at a time
(``offload/streaming.py``). A change to every gradient (``scale_gradients``, ``clamp_gradients``) is done
in place in memory, and recorded for later on NVMe (see [Note: deferred gradient operations] in
``engine/offload/store.py``): it is applied when the optimizer step brings the group in, so a step reads each
gradient once and writes none back.

Clipping by norm: every element of every parameter lives in exactly one rank's shard (padding is never a
parameter), so the global norm is exact: the sum of |g|^p over the local pieces, all-reduced, then the
p-th root (for the infinity norm, the all-reduced maximum). Same clip coefficient as torch's
``clip_grad_norm_``. By value: elementwise, so shards clip exactly.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist

from ..comm.communicator import Communicator
from ..offload.streaming import gradient_pass
from ..shard.flat_group import FlatGroup


def _on_disk(group: FlatGroup) -> bool:
    return group.store is not None and group.store.offload.nvme and not group.store.resident


def visit_gradients(
    groups: list[FlatGroup], params: Optional[set], fn: Callable[[list[torch.Tensor]], None], buffer_count: int
) -> None:
    """``fn(pieces)`` for the gradients of the shard parameters whose ids are in ``params`` (None: all),
    group by group; pieces are read-only when they come from disk."""
    in_memory = [g for g in groups if not _on_disk(g)]
    for group in in_memory:
        if group.store is not None:
            group.store.wait_grads()  # copies from the device may still be writing them
        pieces = [s.shard_param.grad for s in group.trainable_slots if _wanted(s.shard_param, params)]
        pieces = [g for g in pieces if g is not None and g.numel() > 0]
        if pieces:
            fn(pieces)
    on_disk = [g.store for g in groups if _on_disk(g)]
    if on_disk:

        def use(store, flat: torch.Tensor) -> None:
            pieces = [flat[v.lo : v.hi] for v in store.trainable_views if v.hi > v.lo and _wanted(v.param, params)]
            if pieces:
                fn(pieces)

        gradient_pass(on_disk, buffer_count, use)


def _wanted(param: torch.Tensor, params: Optional[set]) -> bool:
    return params is None or id(param) in params


def scale_gradients(groups: list[FlatGroup], params: Optional[set], factor: torch.Tensor) -> None:
    _change(groups, params, "mul", factor, lambda g: g.mul_(factor.to(g.device, g.dtype)))


def clamp_gradients(groups: list[FlatGroup], params: Optional[set], value: float) -> None:
    _change(groups, params, "clamp", value, lambda g: g.clamp_(-value, value))


def _change(groups: list[FlatGroup], params: Optional[set], op: str, value: object, apply: Callable) -> None:
    for group in groups:
        if _on_disk(group):
            group.store.defer(op, value, params)
            continue
        if group.store is not None:
            group.store.wait_grads()
        for slot in group.trainable_slots:
            grad = slot.shard_param.grad
            if grad is not None and grad.numel() and _wanted(slot.shard_param, params):
                apply(grad.detach())


def clip_grad_norm_(
    groups: list[FlatGroup], params: Optional[set], max_norm: float, comm: Communicator, norm_type: float, buffer_count: int
) -> torch.Tensor:
    """Scale the shard gradients so that the global norm of the full gradients is at most ``max_norm``."""
    device = comm.device  # where the reduction runs (offloaded gradients sit on the host)
    norm_type = float(norm_type)
    infinite = math.isinf(norm_type)
    partial = torch.zeros(1, dtype=torch.float32, device=device)

    def add(pieces: list[torch.Tensor]) -> None:
        for g in pieces:
            if infinite:
                partial.copy_(torch.maximum(partial, g.detach().abs().max().float().to(device)))
            else:
                partial.add_((torch.linalg.vector_norm(g.detach().float(), norm_type) ** norm_type).to(device))

    visit_gradients(groups, params, add, buffer_count)
    if infinite:
        total = comm.all_reduce(partial, op=dist.ReduceOp.MAX)[0]
    else:
        total = comm.all_reduce(partial)[0] ** (1.0 / norm_type)
    clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    scale_gradients(groups, params, clip_coef)
    return total


def unscale_gradients_(
    groups: list[FlatGroup], params: Optional[set], inverse_scale: float, comm: Communicator, buffer_count: int
) -> bool:
    """Divide the gradients by the loss scale; True when any rank found a non-finite gradient (the flag is
    all-reduced, so every rank skips the same step). See [Note: one host read per step]."""
    found = torch.zeros(1, device=comm.device)
    # in memory: unscaled in place; from disk: the read-only copies are checked, the change is deferred
    visit_gradients(groups, params, lambda pieces: unscale_(pieces, found, inverse_scale), buffer_count)
    on_disk = [g for g in groups if _on_disk(g)]
    for group in on_disk:
        group.store.defer("mul", torch.tensor(inverse_scale, dtype=torch.float32), params)
    comm.all_reduce(found, op=dist.ReduceOp.MAX)
    return bool(found.item() > 0)  # the step's one host read


def unscale_(pieces: list[torch.Tensor], found: torch.Tensor, inverse_scale: float) -> None:
    """Multiply ``pieces`` by ``inverse_scale`` in place and raise ``found`` where any element is not finite,
    without asking the host anything.

    [Note: one host read per step]
    Asking "is this gradient finite?" of each shard in Python reads a device flag back to the host once per
    shard: on CUDA, a sync per tensor, each one draining the stream. Instead the gradients are unscaled and
    checked in groups of one device and dtype by ``torch._amp_foreach_non_finite_check_and_unscale_`` (the
    kernel ``torch.amp.GradScaler`` uses, for CPU and CUDA), which raises a flag tensor on that device
    without telling the host. The flags are folded into ``found`` (on the group's device), all-reduced,
    and read once."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for piece in pieces:
        by_kind[(piece.device, piece.dtype)].append(piece)
    for (device, _dtype), grads in by_kind.items():
        flag = found if device == found.device else torch.zeros(1, device=device)
        inverse = torch.full((1,), inverse_scale, dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inverse)
        if flag is not found:
            found.add_(flag.to(found.device))


def ids(params: Optional[Iterable[torch.Tensor]]) -> Optional[set]:
    return None if params is None else {id(p) for p in params}
