"""The user's optimizer, running over this rank's shards; clipping by the global gradient norm.

``configure_optimizers`` builds the optimizer over the model's parameters as usual. ``shard_optimizer``
then swaps, inside each parameter group, every parameter for its shard parameter (same position, same
group, so hyper-parameters, weight-decay splits and LR schedulers that hold the optimizer object keep
working). Optimizer state is created lazily by torch on the first step, so it is born sharded: 1/N
per rank.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import nn

from .comm import Communicator
from .shard import ParamSlot


class OptimizerShardingError(ValueError):
    """The optimizer cannot be moved onto the shards as given."""


def shard_optimizer(optimizer: torch.optim.Optimizer, slots: dict[int, ParamSlot]) -> None:
    """Replace the model parameters in ``optimizer`` by their shard parameters, in place."""
    if optimizer.state:
        raise OptimizerShardingError(
            "zero3: the optimizer already holds state (it has stepped) before sharding; create it in "
            "`configure_optimizers` and do not step it before training starts."
        )
    for index, group in enumerate(optimizer.param_groups):
        sharded = []
        for param in group["params"]:
            slot = slots.get(id(param))
            if slot is None:
                raise OptimizerShardingError(
                    f"zero3: parameter group {index} of {type(optimizer).__name__} holds a tensor of shape "
                    f"{tuple(param.shape)} that is not a parameter of the LightningModule. Build the optimizer "
                    "from `self.parameters()` (or named subsets of them) in `configure_optimizers`."
                )
            sharded.append(slot.shard_param)
        # slice assignment keeps the list object, which some optimizers (LBFGS) hold on to
        group["params"][:] = sharded


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    """The optimizer's parameters in state-dict order (group by group)."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def clip_grad_norm_(
    shard_params: Iterable[torch.Tensor], max_norm: float, comm: Communicator, norm_type: float = 2.0
) -> torch.Tensor:
    """Scale the shard gradients so that the global norm of the full gradients is at most ``max_norm``.

    Every element of every parameter lives in exactly one rank's shard (padding is never a parameter),
    so the global norm is exact: sum of |g|^p over local shards, all-reduced, then the p-th root (for
    the infinity norm, the all-reduced maximum). Same clip coefficient as torch's ``clip_grad_norm_``.
    """
    grads = [p.grad for p in shard_params if p.grad is not None and p.grad.numel() > 0]
    device = comm.device  # where the reduction runs (offloaded gradients sit on the host)
    norm_type = float(norm_type)
    if math.isinf(norm_type):
        local = torch.stack([g.detach().abs().max().float().to(device) for g in grads]).max() if grads else None
        total = local if local is not None else torch.zeros((), device=device)
        total = comm.all_reduce(total.reshape(1).clone(), op=torch.distributed.ReduceOp.MAX)[0]
    else:
        powered = torch.zeros(1, dtype=torch.float32, device=device)
        for g in grads:
            powered += (torch.linalg.vector_norm(g.detach().float(), norm_type) ** norm_type).to(device)
        total = comm.all_reduce(powered)[0] ** (1.0 / norm_type)
    clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.detach().mul_(clip_coef.to(g.device, g.dtype))
    return total


def clip_grad_value_(shard_params: Iterable[torch.Tensor], clip_value: float) -> None:
    """Clamp every gradient element into [-clip_value, clip_value]: elementwise, so shards clip exactly."""
    for p in shard_params:
        if p.grad is not None:
            p.grad.detach().clamp_(-clip_value, clip_value)
