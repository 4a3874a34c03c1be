"""One rank of a 2-rank zero3 run in which the ranks issue different collectives, or which is sent SIGTERM
while its ranks wait; ``tests/failures/test_hangs.py`` starts it.

    python tests/scripts/hangs_run.py --case save_rank0 --out DIR   (with a rank's environment, as torchrun)
    python tests/scripts/hangs_run.py --case sigterm --out DIR      (plain: Lightning's launcher starts rank 1)

Cases (the mismatch comes at step 2; ``hang_timeout`` is 2 s here, so that each run takes seconds):
  save_rank0     Trainer: ``trainer.save_checkpoint`` in ``training_step`` on rank 0 only
  export_rank0   Trainer: ``save_full_weights`` in ``training_step`` on rank 0 only
  skip_backward  Trainer: ``training_step`` returns None on rank 1 only (no backward there)
  fabric_save    Fabric: ``fabric.save`` on rank 0 only
  sigterm        Trainer under NVMe offload: rank 0 only saves (``hang_timeout`` off, so the ranks wait
                 for ever); the test sends SIGTERM to one rank once both have written ``waiting``
Each rank writes ``DIR/rank<R>.json``: its pid, and the time the mismatch began where it began.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from gpt import GPT, GPTConfig, GPTModule, random_tokens  # noqa: E402

import lightning_zero3  # noqa: E402
from faults_run import Record  # noqa: E402  (each rank's JSON record, shared with the fault runs)

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
SETTINGS = dict(timeout=timedelta(seconds=120), hang_timeout=2.0, hang_idle_timeout=10.0, persistence_threshold=100,
                tune_collectives=False)  # start in seconds


class Mismatched(GPTModule):
    def __init__(self, case: str, out: Path) -> None:
        super().__init__(CFG)
        self.case, self.out, self.record = case, out, None

    def training_step(self, batch, batch_idx):
        if self.record is None:
            self.record = Record(self.out, self.global_rank)
        if self.global_step == 2:
            if self.case in ("save_rank0", "sigterm") and self.global_rank == 0:
                self.record.write(fault_time=time.time(), waiting=True)
                self.trainer.save_checkpoint(self.out / "ckpt")  # the mistake: rank 0 only
            if self.case == "sigterm" and self.global_rank == 1:
                self.record.write(waiting=True)
            if self.case == "export_rank0" and self.global_rank == 0:
                self.record.write(fault_time=time.time())
                lightning_zero3.save_full_weights(self, self.out / "weights.pt")
            if self.case == "skip_backward" and self.global_rank == 1:
                self.record.write(fault_time=time.time())
                return None
        return super().training_step(batch, batch_idx)


def trainer_run(case: str, out: Path) -> None:
    pl.seed_everything(0)
    torch.set_num_threads(1)
    settings = dict(SETTINGS)
    if case == "sigterm":  # swap files to remove; no hang detection: the ranks wait until the signal
        settings.update(hang_timeout=None, offload_optimizer="nvme", nvme_path=str(out / "nvme"))
    trainer = pl.Trainer(
        strategy=lightning_zero3.Zero3Strategy(**settings), accelerator="cpu", devices=2, max_steps=6,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    data = random_tokens(64, CFG.block_size, CFG.vocab_size, seed=1)
    trainer.fit(Mismatched(case, out), DataLoader(data, batch_size=4))
    Record(out, trainer.global_rank).write(finished=True)


def fabric_run(out: Path) -> None:
    from lightning.fabric import Fabric

    fabric = Fabric(strategy=lightning_zero3.Zero3FabricStrategy(**SETTINGS), accelerator="cpu", devices=2)
    fabric.launch()
    record = Record(out, fabric.global_rank)
    fabric.seed_everything(0)
    model = GPT(CFG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    x, y = random_tokens(64, CFG.block_size, CFG.vocab_size, seed=1).tensors
    for step in range(6):
        if step == 2 and fabric.global_rank == 0:
            record.write(fault_time=time.time())
            fabric.save(out / "ckpt", {"model": model, "optimizer": optimizer})  # the mistake: rank 0 only
        logits = model(x[step * 4 : step * 4 + 4])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y[step * 4 : step * 4 + 4].reshape(-1))
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    record.write(finished=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.case == "fabric_save":
        fabric_run(args.out)
    else:
        trainer_run(args.case, args.out)


if __name__ == "__main__":
    main()
