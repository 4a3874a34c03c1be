"""Where each user parameter lives in its unit's flat buffer, and the dtypes around the shards.

Plain records, below everything that shards: the flat group (``shard/flat_group.py``) makes them, the
optimizer (``grads/optim.py``) and the state code read them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn


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
    shard_param: nn.Parameter  # this rank's piece of ``param``, a view into the group's master
    lo: int  # the piece's position inside the shard
    hi: int

    def piece_start(self, rank: int, shard_numel: int) -> int:
        """Where this rank's piece starts inside the flattened parameter."""
        return rank * shard_numel + self.lo - self.offset
