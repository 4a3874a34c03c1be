"""The main job: a byte-level GPT trained on the Python standard library's sources with ``strategy="zero3"``.

    python examples/train_gpt.py                      # 2 CPU processes, logs to ./runs (TensorBoard)
    python examples/train_gpt.py --devices 4 --max-steps 200 --n-layer 6
    tensorboard --logdir runs

Multi-node runs use Lightning's own launchers: ``torchrun --nnodes ... examples/train_gpt.py --num-nodes ...``
or ``srun`` under SLURM; nothing here is specific to one machine.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, Subset

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning_zero3  # noqa: E402,F401  (registers strategy="zero3")
from data import ByteWindows, stdlib_corpus  # noqa: E402
from gpt import GPTConfig, GPTModule, count_parameters  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--strategy", default="zero3")
    p.add_argument("--max-steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--corpus-bytes", type=int, default=4_000_000)
    p.add_argument("--logdir", default="runs")
    return p.parse_args(argv)


def main(argv=None) -> float:
    args = parse_args(argv)
    pl.seed_everything(0)
    cfg = GPTConfig(
        vocab_size=256, block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd
    )
    model = GPTModule(cfg, lr=args.lr)
    windows = ByteWindows(stdlib_corpus(args.corpus_bytes), args.block_size)
    n_val = max(len(windows) // 50, args.batch_size)
    train = Subset(windows, range(n_val, len(windows)))
    val = Subset(windows, range(n_val))
    trainer = pl.Trainer(
        strategy=args.strategy,
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        max_steps=args.max_steps,
        val_check_interval=min(50, args.max_steps),
        limit_val_batches=4,
        log_every_n_steps=5,
        gradient_clip_val=1.0,
        logger=TensorBoardLogger(args.logdir, name=f"gpt-{args.strategy}"),
        enable_checkpointing=False,
    )
    trainer.fit(
        model,
        DataLoader(train, batch_size=args.batch_size, shuffle=True),
        DataLoader(val, batch_size=args.batch_size),
    )
    loss = float(trainer.callback_metrics["train_loss"])
    if trainer.is_global_zero:
        print(
            f"trained a {count_parameters(model) / 1e6:.1f}M-parameter GPT with strategy={args.strategy!r} on "
            f"{args.devices * args.num_nodes} processes for {trainer.global_step} steps: train_loss {loss:.3f}, "
            f"val_loss {float(trainer.callback_metrics['val_loss']):.3f}. "
            f"TensorBoard: tensorboard --logdir {trainer.logger.log_dir}"
        )
    return loss


if __name__ == "__main__":
    torch.set_float32_matmul_precision("high")
    main()
