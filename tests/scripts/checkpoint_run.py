"""Sharded checkpoints written by Lightning's ModelCheckpoint on N CPU ranks, and exact resume from them.

  straight  2 epochs of 3 steps; ModelCheckpoint writes step=3 and step=6 at the epochs' ends (kept),
            and last.ckpt every 2 steps (overwritten in place); an LR scheduler steps every batch.
  resumed   fit(ckpt_path=<step=3>) for the second epoch.
  validate  validate(ckpt_path=<step=6>) with a fresh model, against the trained model.
Each rank writes ``OUT/checkpoint-rank<R>.json`` with the losses and what the checkpoint folders hold.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from gpt import GPTConfig, GPTModule, random_tokens  # noqa: E402

import lightning_zero3  # noqa: E402

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


class ScheduledGPT(GPTModule):
    def __init__(self) -> None:
        super().__init__(CFG)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = self.model.loss(*batch)
        self.losses.append(float(self.trainer.strategy.reduce(loss.detach(), reduce_op="mean")))
        return loss

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def run(devices: int, out: Path) -> dict:
    loader = DataLoader(random_tokens(8 * devices * 3, CFG.block_size, CFG.vocab_size), batch_size=8)
    kept, latest = out / "kept", out / "latest"
    runs: dict = {}
    for name, ckpt in (("straight", None), ("resumed", kept / "step=3.ckpt")):
        pl.seed_everything(0)
        model = ScheduledGPT()
        callbacks = [
            ModelCheckpoint(dirpath=kept, filename="{step}", every_n_epochs=1, save_top_k=-1),
            ModelCheckpoint(dirpath=latest, save_last=True, save_top_k=0, every_n_train_steps=2),
        ] if ckpt is None else []  # fmt: skip
        trainer = pl.Trainer(
            strategy=lightning_zero3.Zero3Strategy(persistence_threshold=500), accelerator="cpu", devices=devices,
            max_epochs=2, logger=False, enable_progress_bar=False, callbacks=callbacks,
            enable_checkpointing=ckpt is None,
        )  # fmt: skip
        trainer.fit(model, loader, ckpt_path=ckpt)
        runs[name] = model.losses
        if ckpt is None:  # the trained model (full weights after fit) against a fresh one loaded from step=6
            runs["val_trained"] = trainer.validate(model, loader, verbose=False)[0]["val_loss"]
            fresh = ScheduledGPT()
            runs["val_from_checkpoint"] = trainer.validate(fresh, loader, ckpt_path=kept / "step=6.ckpt",
                                                           verbose=False)[0]["val_loss"]  # fmt: skip
    runs["kept"] = {p.name: sorted(f.name for f in p.iterdir()) for p in sorted(kept.iterdir())}
    runs["latest"] = sorted(p.name for p in latest.iterdir())
    return runs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    result = run(args.devices, args.out)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    (args.out / f"checkpoint-rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
