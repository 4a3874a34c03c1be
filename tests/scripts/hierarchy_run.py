"""Secondary shards through Lightning on two nodes, run by every rank of a launch (SLURM's tasks in the tests).

zero3 for 2 epochs of 3 steps; zero3 with ``secondary_shard_size="node"`` for the same 2 epochs (a sharded
checkpoint at each epoch's end, ``CommMonitor`` logging every step to TensorBoard); the latter resumed from
its first epoch's checkpoint. Each rank writes ``OUT/rank<R>.json``: the per-step losses of the three runs,
the ranks per node and secondary group size the engine resolved, and its byte ledger after the second
run; rank 0 adds the inter-node bytes ``CommMonitor`` logged, summed over the steps.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from lightning.pytorch.loggers import TensorBoardLogger
from multinode_run import STEPS_PER_EPOCH, fit

import lightning_zero3
from lightning_zero3.callbacks import CommMonitor
from lightning_zero3.engine import engine_of

NODES, DEVICES = 2, 2


def zero3(**knobs) -> lightning_zero3.Zero3Strategy:
    return lightning_zero3.Zero3Strategy(persistence_threshold=500, tune_collectives=False, **knobs)


def logged_inter_node(log_dir: str) -> dict[str, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(log_dir, size_guidance={"scalars": 0}).Reload()
    return {
        kind: sum(e.value for e in events.Scalars(f"zero3/comm/{kind}/inter_node_bytes/mean"))
        for kind in ("all_gather", "reduce_scatter")
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    plain = fit(zero3(), NODES, DEVICES)
    logger = TensorBoardLogger(out / "tb", name="hpz")
    hpz = fit(
        zero3(secondary_shard_size="node"), NODES, DEVICES, ckpt_dir=out / "ckpt",
        callbacks=[CommMonitor(every_n_steps=1)], logger=logger, log_every_n_steps=1,
    )  # fmt: skip
    engine = engine_of(hpz)
    by_group = {f"{g}/{k}": {"bytes": s.bytes, "inter_node_bytes": s.inter_node_bytes} for (g, k), s in engine.comm.by_group.items()}
    result = {
        "plain": plain.losses,
        "hpz": hpz.losses,
        "ranks_per_node": engine.comm.topology.ranks_per_node,
        "secondary_size": engine.secondary_size,
        "by_group": by_group,
        "by_kind": {kind: s.inter_node_bytes for kind, s in engine.comm.stats.items()},
    }
    resumed = fit(zero3(secondary_shard_size="node"), NODES, DEVICES, ckpt_path=out / "ckpt" / f"step={STEPS_PER_EPOCH}.ckpt")
    result["resumed"] = resumed.losses
    rank = torch.distributed.get_rank()
    if rank == 0:
        result["logged_inter_node"] = logged_inter_node(logger.log_dir)
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
