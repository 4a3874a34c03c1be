"""The user's optimizer, running over this rank's shards (clipping lives in ``gradients.py``).

``configure_optimizers`` builds the optimizer over the model's parameters as usual. ``shard_optimizer``
then swaps, inside each parameter group, every parameter for its shard parameter (same position, same
group, so hyper-parameters, weight-decay splits and LR schedulers that hold the optimizer object keep
working). Optimizer state is created lazily by torch on the first step, so it is born sharded: 1/N
per rank.
"""

from __future__ import annotations

import torch
from torch import nn

from ...errors import OptimizerShardingError
from ..layout.slots import ParamSlot


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
