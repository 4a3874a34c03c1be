"""A callback for tests that run a job through the CLI: each rank writes its whole-run peak resident memory.

The kernel's high-water mark (``VmHWM``) is read when the rank's ``fit`` has ended (``teardown``), and written
to ``$ZERO3_PEAK_RSS_DIR/rank<N>.json``.
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
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        out = Path(os.environ["ZERO3_PEAK_RSS_DIR"])
        out.mkdir(parents=True, exist_ok=True)
        losses = getattr(pl_module, "_peak_rss_losses", None)
        record = {"peak_rss": peak_rss(), "rank": trainer.global_rank, "stage": stage}
        (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))
