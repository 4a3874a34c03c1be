"""Node-local secondary shards (ZeRO++ hpZ): backward re-gathers a unit inside the node.

[Note: secondary shards]
Plain ZeRO-3 all-gathers every unit twice per step over all ranks: for its forward and again for its
backward. With ``secondary_shard_size`` = s (``"node"``: the ranks of one node), the ranks form groups
of s consecutive ranks (Lightning numbers ranks node by node, so with s the ranks of a node a group is a
node). When a unit whose backward will need it again is released after its forward, each rank keeps
its *secondary shard*: its share of the unit's full parameters within its group,
``full[i x L/s : (i+1) x L/s]`` for the rank's index i in the group (L the padded length). Backward's
re-gather (and backward's prefetch) then all-gathers those shards over the group (see [Note: node-local
secondary groups] in engine/comm/communicator.py): s ranks of one node, no byte crosses a node boundary. Gradients still
reduce-scatter over all ranks, into the primary shards.

The copy is taken from the gathered buffer itself, so it holds exactly the values forward used (under
``quantize_gathers`` the dequantized ones, sent as they are), and backward differentiates those: fp32
training is bitwise the same as without it. Any gather of the unit reads the secondary shard while it
is valid (a unit called twice in one forward gathers inside the node the second time too).

Lifetime: valid from the unit's release after forward until its backward is over (then it is released:
``UnitRuntime.end_backward``), or until the primary shards change under it (an optimizer step, a loaded
checkpoint, ``gathered_parameters(modifier_rank=...)``): then it is dropped and the next gather goes
over all ranks. A unit kept gathered from forward into backward (``max_reuse_distance``) needs none.

Memory: a secondary shard is L/s elements in the compute dtype, counted in the ledger as
``secondary_shards``. At the peak, between the end of forward and the start of backward, every unit
released after its forward holds one: about 1/s of the model's gathered size (1/8 on 8-GPU nodes),
against 1/N for the primary shards.

Every rank decides alike whether a gather reads secondary shards: a secondary shard exists when its
unit was released after a forward with gradients, which every rank runs alike (every gather is checked,
see comm/agreement.py), and is dropped at the end of the unit's backward, after which the unit is not
gathered again in that backward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Union

import torch

from ...errors import Zero3ConfigError
from ..memory.buffers import SECONDARY_SHARDS, ByteLedger, reclaim, releasable_buffer, release

if TYPE_CHECKING:
    from ..comm.communicator import Communicator


def resolve_size(setting: Union[int, str, None], comm: "Communicator") -> Optional[int]:
    """The group size ``secondary_shard_size`` asks for on this job, or None when it changes nothing (off,
    or a group as large as the job). ``"node"``: the communicator's ranks per node."""
    if setting is None:
        return None
    size = comm.topology.ranks_per_node if setting == "node" else int(setting)
    world = comm.world_size
    if size < 1 or world % size:
        what = f"{size} ranks per node" if setting == "node" else f"{size}"
        raise Zero3ConfigError(
            f"zero3: `secondary_shard_size={setting!r}` ({what}) must divide the number of ranks ({world}): "
            "secondary shards are kept in groups of that many consecutive ranks. Use a divisor of the world "
            'size, "node" for the ranks of one node (Lightning numbers ranks node by node), or None.'
        )
    return size if size < world else None


class SecondaryShard:
    """One unit's secondary shard (see [Note: secondary shards]): ``width`` elements of ``full`` from ``start``."""

    def __init__(self, full_numel: int, size: int, index: int, dtype: torch.dtype, device: torch.device, ledger: ByteLedger) -> None:
        self.width = full_numel // size
        self.start = index * self.width
        self.ledger = ledger
        self.buffer = releasable_buffer(self.width, dtype, device)
        release(self.buffer)
        self.nbytes = self.width * self.buffer.element_size()
        self.valid = False  # holds the unit's current values
        self.wanted = False  # keep it when the unit is released (its backward will gather it again)

    def keep(self, full: torch.Tensor) -> None:
        """Take this rank's share of the gathered ``full`` (at the unit's release after forward)."""
        self.wanted = False
        if self.valid:
            return
        reclaim(self.buffer)
        self.ledger.add(SECONDARY_SHARDS, self.nbytes)
        with torch.no_grad():
            self.buffer.copy_(full[self.start : self.start + self.width])
        self.valid = True

    def drop(self) -> None:
        """Its backward is over, or the primary shards changed: give the memory back."""
        self.wanted = False
        if self.valid:
            release(self.buffer)
            self.ledger.remove(SECONDARY_SHARDS, self.nbytes)
            self.valid = False
