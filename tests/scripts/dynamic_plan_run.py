"""A GPT fit on 2 CPU ranks whose first batches are 4x shorter than the later ones, with or without the
automatic offload plan under a memory budget (engine/plan/dynamic.py).

    python dynamic_plan_run.py OUT --steps N [--budget BYTES --nvme DIR] [--save PATH] [--resume PATH]
                               [--gpt VOCAB,BLOCK,LAYERS,HEADS,WIDTH --batch B]   # another shape than CFG's
                               [--short-batches N]   # per rank, 4x shorter (default 3; 0: all whole)
                               [--short-len T]   # tokens of the short samples (default a quarter of CFG's)
                               [--largest-unknown]   # the data module does not name its largest sample
                               [--fixed-nvme BUFFERS [--lean]]   # all->nvme by hand; --lean: the leanest level

The data module names its largest sample (``largest_sample_index``), so the plan at setup is sized to the
long batches; with ``--largest-unknown`` it does not, the plan is sized to the first (short) batch and
must adapt while training. Each rank writes ``OUT/rank<R>.json``: its whole-run peak resident memory (``VmHWM`` when
``fit`` has returned), the losses, the seconds of each step after the first, the plan level at the first step and at the end, and the plan changes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from gpt import GPTConfig, GPTModule  # noqa: E402

import lightning_zero3  # noqa: E402

CFG = GPTConfig(vocab_size=512, block_size=256, n_layer=6, n_head=4, n_embd=512)
BATCH = 4
SHORT_BATCHES = 3  # per rank, each 4x shorter than the later ones
SHORT_LEN = None  # tokens of their samples (None: a quarter of the block)


class Lengths(Dataset):
    """Random token windows: the first ``short`` are ``SHORT_LEN`` long (a quarter of ``CFG.block_size``
    unless set), the rest whole."""

    def __init__(self, n: int, short: int) -> None:
        self.n, self.short = n, short

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        length = (SHORT_LEN or CFG.block_size // 4) if i < self.short else CFG.block_size
        tokens = torch.randint(0, CFG.vocab_size, (length + 1,), generator=torch.Generator().manual_seed(i))
        return tokens[:-1], tokens[1:]


class ShortThenLong(pl.LightningDataModule):
    def __init__(self, steps: int) -> None:
        super().__init__()
        world = 2
        self.data = Lengths(steps * BATCH * world, SHORT_BATCHES * BATCH * world)  # in order: ranks interleave

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer  # in order, rank by rank: the first batches of every rank are the short ones
        sampler = DistributedSampler(self.data, trainer.world_size, trainer.global_rank, shuffle=False)
        return DataLoader(self.data, batch_size=BATCH, sampler=sampler)


class ShortThenLongKnown(ShortThenLong):
    def largest_sample_index(self) -> int:
        return len(self.data) - 1


class Recorder(pl.Callback):
    def __init__(self, lean: bool = False) -> None:
        self.losses: list[float] = []
        self.first_level = None
        self.lean = lean
        self.ends: list[float] = []  # when each step ended (perf_counter)

    def on_train_start(self, trainer, pl_module) -> None:
        if self.lean:  # the plan's leanest level, taken by hand (engine/plan/dynamic.py)
            trainer.strategy._engine.set_trim_between_phases(True)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        plan = trainer.strategy._engine.dynamic_plan
        if self.first_level is None and plan is not None:
            self.first_level = plan.level

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))
        self.ends.append(time.perf_counter())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--budget", type=int)
    p.add_argument("--nvme")
    p.add_argument("--save")
    p.add_argument("--resume")
    p.add_argument("--gpt", help="vocab,block,layers,heads,width")
    p.add_argument("--batch", type=int)
    p.add_argument("--short-batches", type=int)
    p.add_argument("--largest-unknown", action="store_true")
    p.add_argument("--short-len", type=int)
    p.add_argument("--fixed-nvme", type=int, metavar="BUFFERS", help="all->nvme set by hand, prefetch off (with --nvme)")
    p.add_argument("--lean", action="store_true", help="with --fixed-nvme: idle buffers returned between phases")
    args = p.parse_args()
    global CFG, BATCH, SHORT_BATCHES, SHORT_LEN
    SHORT_LEN = args.short_len
    SHORT_BATCHES = SHORT_BATCHES if args.short_batches is None else args.short_batches
    if args.gpt:
        vocab, block, layers, heads, width = map(int, args.gpt.split(","))
        CFG = GPTConfig(vocab_size=vocab, block_size=block, n_layer=layers, n_head=heads, n_embd=width)
    BATCH = args.batch or BATCH
    knobs = {"persistence_threshold": 1000}
    if args.budget:
        knobs.update(offload_optimizer="auto", offload_params="auto", memory_budget=args.budget, nvme_path=args.nvme)
    if args.fixed_nvme:
        knobs.update(offload_optimizer="nvme", offload_params="nvme", nvme_path=args.nvme,
                     offload_buffer_count=args.fixed_nvme, prefetch_bucket_size=0)  # fmt: skip
    pl.seed_everything(0)
    recorder = Recorder(lean=args.lean)
    trainer = pl.Trainer(strategy=lightning_zero3.Zero3Strategy(**knobs), accelerator="cpu", devices=2,
                         max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[recorder], use_distributed_sampler=False)  # fmt: skip
    model = GPTModule(CFG, sharded_init=True)
    data = (ShortThenLong if args.largest_unknown else ShortThenLongKnown)(args.steps)
    trainer.fit(model, datamodule=data, ckpt_path=args.resume)
    if args.save:
        trainer.save_checkpoint(args.save)
    plan = trainer.strategy._engine.dynamic_plan
    status = Path("/proc/self/status").read_text().splitlines()
    peak = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
    record = {"peak": peak, "losses": recorder.losses, "first_level": recorder.first_level,
              "step_seconds": [b - a for a, b in zip(recorder.ends, recorder.ends[1:])],
              "level": plan and plan.level, "changes": plan and plan.changes,
              "estimate": trainer.strategy._engine.plan_estimate and trainer.strategy._engine.plan_estimate.device_bytes_per_rank}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
