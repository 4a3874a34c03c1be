"""A callback for tests that run a job through the CLI: each rank writes its whole-run peak resident memory
and the loss of every training step.

The kernel's high-water mark (``VmHWM``) is read when the rank's ``fit`` has ended (``teardown``), and written
to ``$ZERO3_PEAK_RSS_DIR/rank<N>.json`` with the losses and the offload plan the engine ran (``plan``: the
two offload settings after "auto" was resolved, and why).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning.pytorch as pl


def peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


class PeakRSS(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.plan = None

    def on_train_start(self, trainer, pl_module) -> None:
        engine = getattr(trainer.strategy, "_engine", None)
        if engine is not None:
            self.plan = {"offload_optimizer": engine.config.offload_optimizer,
                         "offload_params": engine.config.offload_params, "why": engine.plan_choice}  # fmt: skip

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss.detach()))

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        out = Path(os.environ["ZERO3_PEAK_RSS_DIR"])
        out.mkdir(parents=True, exist_ok=True)
        record = {"peak_rss": peak_rss(), "rank": trainer.global_rank, "stage": stage, "losses": self.losses,
                  "plan": self.plan}  # fmt: skip
        (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))
