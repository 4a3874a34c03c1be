"""litgpt's own jobs through ``examples/litgpt_zero3.py`` on 2 CPU ranks, in one pair of processes: pretraining
under zero3 and FSDP2 (20 steps), full fine-tuning under zero3 and DDP, LoRA fine-tuning under zero3 (10
steps each). Each job writes its logged losses to ``OUT/<job>-<strategy>/losses-<rank>.json``."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

from litgpt_zero3 import run  # noqa: E402

JOBS = [("pretrain", "zero3", 20), ("pretrain", "fsdp2", 20), ("finetune_full", "zero3", 10),
        ("finetune_full", "ddp", 10), ("finetune_lora", "zero3", 10)]  # fmt: skip

if __name__ == "__main__":
    out = Path(sys.argv[1])
    for job, strategy, steps in JOBS:
        run(job, strategy, out / f"{job}-{strategy}", devices=2, steps=steps)
