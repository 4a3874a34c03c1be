"""Which node each rank runs on, and how many bytes of a collective cross a node boundary.

Ranks are numbered node by node, as Lightning and torchrun number them (global rank = node rank x ranks
per node + local rank), so a rank's node is ``global_rank // ranks_per_node``. The ``Communicator``
learns ``ranks_per_node`` from whoever builds it: the strategy passes the Trainer's ``devices``; an
engine used without Lightning takes ``LOCAL_WORLD_SIZE`` (set by torchrun), else one node for the job.

[Note: inter-node bytes]
The byte ledger (``comm/communicator.py``) counts, for every collective, the bytes *this rank receives from ranks on
other nodes*, in the algorithm-neutral sense: every piece of data the rank needs from another rank is
received once, directly. For a collective whose full buffer holds S bytes (the gathered output of an
all-gather, the input of a reduce-scatter or all-reduce: nccl-tests' S), over a group of n ranks of
which m sit on other nodes than this rank:

- all-gather: the rank receives the other n-1 pieces of S/n; m of them come from other nodes: S x m / n;
- reduce-scatter: the rank receives, for its slice of S/n, the contributions of the other n-1 ranks;
  m of them come from other nodes: S x m / n;
- all-reduce: a reduce-scatter followed by an all-gather of the result: 2 x S x m / n (a reduce-scatter
  that a backend runs as an all-reduce, see [Note: measured collective choice], counts as what it runs);
- broadcast: S when the source is on another node, else 0.

Every strategy compared in ``examples/benchmarks/benchmark.py`` is counted by the same rule. It is the data that
must come over the network, not what a given implementation sends: a ring that passes pieces along
carries some of them across a boundary more than once, and a topology-aware one (NCCL's trees, a
hierarchical all-gather) can bring a remote piece into a node once and share it there. Per node, the
figure is the sum over the node's ranks. The identity checks that precede every all-gather (80 bytes
each, [Note: every all-gather is checked] in agreement.py) are counted too, on their own group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class Topology:
    """How the job's ranks are spread over nodes: ``ranks_per_node`` consecutive global ranks per node."""

    ranks_per_node: int

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1:
            raise ValueError(f"zero3: ranks per node must be >= 1, got {self.ranks_per_node}.")

    @classmethod
    def from_environment(cls, world_size: int, ranks_per_node: Optional[int] = None) -> "Topology":
        """``ranks_per_node`` if given, else ``LOCAL_WORLD_SIZE`` (torchrun sets it), else one node."""
        if ranks_per_node is None:
            local = os.environ.get("LOCAL_WORLD_SIZE")
            ranks_per_node = int(local) if local and local.isdigit() and int(local) > 0 else max(1, world_size)
        return cls(int(ranks_per_node))

    def node_of(self, global_rank: int) -> int:
        return global_rank // self.ranks_per_node

    def remote_members(self, members: Sequence[int], me: int) -> int:
        """How many of ``members`` (global ranks) are on another node than ``me``."""
        mine = self.node_of(me)
        return sum(1 for rank in members if self.node_of(rank) != mine)


def inter_node_bytes(kind: str, nbytes: int, n: int, remote: int) -> int:
    """Bytes this rank receives from other nodes in one collective (see [Note: inter-node bytes]): ``nbytes``
    the full buffer, ``n`` ranks in the group, ``remote`` of them on other nodes. Broadcasts are counted
    by the caller (they depend on where the source is)."""
    if n <= 1 or remote == 0:
        return 0
    if kind == "all_reduce":
        return 2 * nbytes * remote // n
    if kind in ("all_gather", "reduce_scatter", "check"):
        return nbytes * remote // n
    raise ValueError(f"no inter-node byte rule for {kind!r}")
