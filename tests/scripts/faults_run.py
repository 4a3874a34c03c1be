"""One rank of a 2-rank zero3 fit into which one fault is injected; ``tests/failures/test_faults.py`` starts both ranks
itself (as torchrun would: ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_PORT`` set) to see each rank's exit.

    python tests/scripts/faults_run.py --fault kill_step --out DIR     (with the rank's environment)

The fit saves ``DIR/ckpt`` (sharded) after step 2, and again (same name) after step 4. Faults:
  kill_step   rank 1 SIGKILLs itself at step 3
  exception   rank 1 raises at step 3 (only rank 1); optimizer state offloaded to NVMe swap files under DIR/nvme
  kill_save   rank 0 SIGKILLs itself in the second save, its shards written, before the manifest
  commit      the second save's rename into place fails on rank 0 (an injected EIO)
  enospc      rank 1's disk is full while it writes its shards of the second save (an injected ENOSPC)
Each rank writes ``DIR/rank<R>.json`` at start (pid) and, on the rank that injects it, the fault's time.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import signal
import sys
import time
import types
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from gpt import GPTConfig, GPTModule, random_tokens  # noqa: E402

import lightning_zero3  # noqa: E402

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
TIMEOUT = timedelta(seconds=20)


class Record:
    def __init__(self, out: Path, rank: int) -> None:
        self.file = out / f"rank{rank}.json"
        self.data = {"pid": os.getpid()}
        self.write()

    def write(self, **more) -> None:
        self.data.update(more)
        self.file.write_text(json.dumps(self.data))


def kill_self(record: Record) -> None:
    record.write(fault_time=time.time())
    os.kill(os.getpid(), signal.SIGKILL)


class Faults(pl.Callback):
    def __init__(self, fault: str, out: Path, record: Record) -> None:
        self.fault, self.out, self.record = fault, out, record

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == 3 and trainer.global_rank == 1:
            if self.fault == "kill_step":
                kill_self(self.record)
            if self.fault == "exception":
                self.record.write(fault_time=time.time())
                raise ValueError("injected failure on rank 1 only")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step in (2, 4):
            if trainer.global_step == 4:
                self.inject_into_save(trainer.global_rank)
            trainer.save_checkpoint(self.out / "ckpt")
            if trainer.global_step == 2:
                self.record.write(saved_step=2)

    def inject_into_save(self, rank: int) -> None:
        record = self.record
        if self.fault == "kill_save" and rank == 0:
            from lightning_zero3.checkpoint import api

            api.write_manifest = lambda *args, **kwargs: kill_self(record)
        if self.fault == "commit" and rank == 0:
            from lightning_zero3.checkpoint import atomic

            def rename(src, dst):
                if ".partial-" in str(src):
                    record.write(fault_time=time.time())
                    raise OSError(errno.EIO, "Input/output error (injected)", str(dst))
                os.rename(src, dst)

            atomic.os = types.SimpleNamespace(**{**vars(os), "rename": rename})
        if self.fault == "enospc" and rank == 1:
            from torch.distributed.checkpoint import filesystem

            class Full:
                def write(self, data):
                    record.write(fault_time=time.time())
                    raise OSError(errno.ENOSPC, "No space left on device (injected)")

                def __getattr__(self, name):
                    return lambda *args, **kwargs: 0

            @contextlib.contextmanager
            def create_stream(self, path, mode):
                yield Full()

            filesystem.FileSystem.create_stream = create_stream


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rank = int(os.environ["LOCAL_RANK"])
    record = Record(args.out, rank)
    pl.seed_everything(0)
    torch.set_num_threads(1)
    data = random_tokens(64, CFG.block_size, CFG.vocab_size, seed=1)
    # with NVMe offload in one case: the swap folders must go also when the watchdog ends the process
    offload = {"offload_optimizer": "nvme", "nvme_path": str(args.out / "nvme")} if args.fault == "exception" else {}
    trainer = pl.Trainer(
        strategy=lightning_zero3.Zero3Strategy(timeout=TIMEOUT, persistence_threshold=100, **offload),
        accelerator="cpu",
        devices=2,
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Faults(args.fault, args.out, record)],
    )
    trainer.fit(GPTModule(CFG), DataLoader(data, batch_size=4))
    record.write(finished=True)


if __name__ == "__main__":
    main()
