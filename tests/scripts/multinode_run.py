"""Training on several nodes, run by every rank of a launch (torchrun, SLURM, or Lightning's own launcher).

Modes:
  train   on ``--nodes`` x ``--devices`` ranks: zero3 for 2 epochs of 3 steps, ModelCheckpoint writing a
          sharded checkpoint at each epoch's end; zero3 again, resumed from the first epoch's checkpoint;
          DDP for the same 2 epochs. Every rank records who it is (ranks, node, cluster environment,
          compute threads), the sample indices it trained on and the per-step losses (mean over ranks).
  resume  resume zero3 from ``--ckpt`` (written by ``train``, possibly on another layout) for the second
          epoch, with the per-rank batch scaled so that every step sees the same global batch.
Each rank writes ``OUT/<mode>-rank<R>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from gpt import GPTConfig, GPTModule, random_tokens  # noqa: E402

import lightning_zero3  # noqa: E402

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
STEPS_PER_EPOCH = 3
GLOBAL_BATCH = 8  # samples per optimizer step, split evenly over the ranks


def indexed_data() -> TensorDataset:
    x, y = random_tokens(GLOBAL_BATCH * STEPS_PER_EPOCH, CFG.block_size, CFG.vocab_size, seed=3).tensors
    return TensorDataset(x, y, torch.arange(len(x)))


class RecordingGPT(GPTModule):
    """Records the mean loss over ranks at every step, the sample indices this rank trained on, and what
    this rank knows about its place in the job once training starts."""

    def __init__(self) -> None:
        super().__init__(CFG)
        self.losses: list[float] = []
        self.seen: list[list[int]] = []  # per epoch
        self.identity: dict = {}

    def on_train_start(self) -> None:
        trainer = self.trainer
        strategy = trainer.strategy
        self.identity = {
            "global_rank": trainer.global_rank,
            "local_rank": trainer.local_rank,
            "node_rank": trainer.node_rank,
            "world_size": trainer.world_size,
            "num_nodes": trainer.num_nodes,
            "dist_rank": torch.distributed.get_rank(),
            "dist_world_size": torch.distributed.get_world_size(),
            "rank_zero_only": rank_zero_only.rank,
            "is_global_zero": trainer.is_global_zero,
            "cluster_environment": type(strategy.cluster_environment).__name__,
            "sampler": type(trainer.train_dataloader.sampler).__name__,
            "threads": torch.get_num_threads(),
            "ranks_sharing_cores": getattr(strategy, "ranks_sharing_cores", None),
            "launch": os.environ.get("MULTINODE_LAUNCH"),
        }

    def on_train_epoch_start(self) -> None:
        self.seen.append([])

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        self.seen[-1] += index.tolist()
        loss = self.model.loss(x, y)
        self.losses.append(float(self.trainer.strategy.reduce(loss.detach(), reduce_op="mean")))
        return loss


def fit(
    strategy, nodes: int, devices: int, ckpt_dir: Path | None = None, ckpt_path: Path | None = None,
    callbacks: list | None = None, **trainer_flags,
):  # fmt: skip
    """Two epochs; with ``ckpt_dir``, a checkpoint at each epoch's end; from ``ckpt_path`` if given;
    ``callbacks`` and ``trainer_flags`` (a logger, ...) go to the Trainer."""
    pl.seed_everything(0)
    model = RecordingGPT()
    every_epoch = ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", every_n_epochs=1, save_top_k=-1)
    callbacks = ([every_epoch] if ckpt_dir else []) + (callbacks or [])
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", num_nodes=nodes, devices=devices, max_epochs=2,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, enable_checkpointing=bool(ckpt_dir),
        **{"logger": False, **trainer_flags},
    )  # fmt: skip
    loader = DataLoader(indexed_data(), batch_size=GLOBAL_BATCH // (nodes * devices))
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    return model


def zero3() -> lightning_zero3.Zero3Strategy:
    return lightning_zero3.Zero3Strategy(persistence_threshold=500)


def train(nodes: int, devices: int, out: Path) -> dict:
    ckpt_dir = out / "ckpt"
    straight = fit(zero3(), nodes, devices, ckpt_dir=ckpt_dir)
    resumed = fit(zero3(), nodes, devices, ckpt_path=ckpt_dir / f"step={STEPS_PER_EPOCH}.ckpt")
    ddp = fit("ddp", nodes, devices)
    return {
        "identity": straight.identity,
        "ddp_identity": ddp.identity,
        "seen": straight.seen,
        "zero3": straight.losses,
        "resumed": resumed.losses,
        "ddp": ddp.losses,
        "checkpoints": {p.name: sorted(f.name for f in p.iterdir()) for p in sorted(ckpt_dir.iterdir())},
    }


def resume(nodes: int, devices: int, ckpt: Path) -> dict:
    resumed = fit(zero3(), nodes, devices, ckpt_path=ckpt)
    return {"identity": resumed.identity, "resumed": resumed.losses, "seen": resumed.seen}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train", "resume"])
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ckpt", type=Path)
    args = parser.parse_args()
    if args.mode == "train":
        result = train(args.nodes, args.devices, args.out)
    else:
        result = resume(args.nodes, args.devices, args.ckpt)
    (args.out / f"{args.mode}-rank{torch.distributed.get_rank()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
