"""A zero3 fit on 2 CPU ranks with both monitors on and the GPT built in ``configure_model`` (sharded init).

Each rank writes ``OUT/rank<R>.json``: whether the GPT was on the meta device inside ``configure_model``,
the engine's ``memory_report()`` at every logged step, the train losses, and (rank 0) what the monitors
logged last. TensorBoard event files land under ``OUT/tb``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from gpt import GPTConfig, GPTModule, random_tokens  # noqa: E402

import lightning_zero3  # noqa: E402
from lightning_zero3.callbacks import CommMonitor, MemoryMonitor  # noqa: E402

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=64)
EVERY = 2
STEPS = 6


class ShardedInitGPT(GPTModule):
    def __init__(self) -> None:
        super().__init__(CFG, sharded_init=True)
        self.built_on_meta = None
        self.losses: list[float] = []

    def configure_model(self) -> None:
        super().configure_model()
        self.built_on_meta = all(p.is_meta for p in self.model.parameters())

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.losses.append(float(loss))
        return loss


class Probe(pl.Callback):
    """The engine's own accounting at the steps the monitors log (it runs after them)."""

    def __init__(self) -> None:
        self.reports: dict[int, dict] = {}

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if trainer.global_step % EVERY == 0:
            self.reports[trainer.global_step] = trainer.strategy.engine.memory_report()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    pl.seed_everything(0)
    model, probe = ShardedInitGPT(), Probe()
    monitors = [MemoryMonitor(every_n_steps=EVERY, fragmentation_threshold=0.001, min_wasted_bytes=0, min_wasted_share=0), CommMonitor(every_n_steps=EVERY, exposed_threshold=0)]
    trainer = pl.Trainer(
        strategy=lightning_zero3.Zero3Strategy(persistence_threshold=1000),
        accelerator="cpu",
        devices=2,
        max_steps=STEPS,
        logger=TensorBoardLogger(str(args.out), name="tb"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*monitors, probe],
    )
    data = random_tokens(STEPS * 2 * 4, CFG.block_size, CFG.vocab_size, seed=7)
    trainer.fit(model, DataLoader(data, batch_size=4))
    with lightning_zero3.gathered_parameters(model.model.blocks[0]):  # the model stays sharded after fit
        # after a few small steps the weights are still close to the init: LayerNorm ones, GPT's std 0.02
        ln_mean = float(model.model.blocks[0].ln_1.weight.mean())
        fc_std = float(model.model.blocks[0].fc.weight.std())
    result = {
        "built_on_meta": model.built_on_meta,
        "reports": probe.reports,
        "losses": model.losses,
        "ln_mean": ln_mean,
        "fc_std": fc_std,
        "logged": {type(m).__name__: m.last_logged for m in monitors},
        "log_dir": trainer.logger.log_dir,
    }
    (args.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
