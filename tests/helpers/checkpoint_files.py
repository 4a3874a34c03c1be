"""What a sharded checkpoint directory holds: checked the same way by every test that writes one."""

from __future__ import annotations

from collections import Counter


def assert_sharded_layout(names: list[str], world: int) -> int:
    """``names`` (a checkpoint directory's files) are DCP's index, the trainer state, the manifest and, from
    every rank, one ``__<rank>_<n>.distcp`` file per flat group (see [Note: one file per group] in
    lightning_zero3/checkpoint/dcp_io.py). Returns the number of files per rank."""
    shards = [n for n in names if n.endswith(".distcp")]
    assert sorted(set(names) - set(shards)) == [".metadata", "trainer_state.pt", "zero3.json"], names
    per_rank = Counter(n.split("_")[2] for n in shards)
    assert sorted(per_rank, key=int) == [str(r) for r in range(world)], names
    assert len(set(per_rank.values())) == 1 and per_rank["0"] > 1, per_rank  # every rank, every group
    return per_rank["0"]
