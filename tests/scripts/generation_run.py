"""Hugging Face Mixtral (tiny, random init) under zero3 and DDP on 2 CPU ranks, through Lightning:

  generate   ``trainer.validate``: a validation_step that generates with a KV cache, each rank its own number
             of new tokens, every rank calling the model until all agree to stop; ``trainer.predict``: Hugging
             Face ``generate(..., synced_gpus=True)`` with a different ``max_new_tokens`` per rank.
             Strategies "zero3" and "ddp".
  train      fit with routed experts, SGD and AdamW, under "zero3" and "ddp_find_unused_parameters_true".

Rank 0 writes ``OUT/<mode>-<strategy>[-<optimizer>].pt``; ``tests/engine/test_generation.py`` compares them.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from transformers import MixtralConfig, MixtralForCausalLM

import lightning_zero3

CONFIG = dict(
    vocab_size=48, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
)  # fmt: skip
PROMPTS = torch.randint(0, CONFIG["vocab_size"], (8, 6), generator=torch.Generator().manual_seed(3))


class Mixtral(pl.LightningModule):
    def __init__(self, optimizer: str = "adamw") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = MixtralForCausalLM(MixtralConfig(**CONFIG))
        self.optimizer = optimizer
        self.generated: list[list[int]] = []
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        logits = self.model(batch).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        self.losses.append(float(self.trainer.strategy.reduce(loss.detach().clone(), reduce_op="mean")))
        return loss

    def configure_optimizers(self):
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)

    def validation_step(self, batch, batch_idx):
        """Greedy generation with a KV cache: rank r wants 2 + 3r new tokens; all ranks keep calling the
        model until every rank has its tokens (the stop is agreed by an all-reduce, as synced_gpus does)."""
        wanted = 2 + 3 * self.global_rank + batch_idx
        out = self.model(batch, use_cache=True)
        cache, token = out.cache, out.logits[:, -1:].argmax(-1)
        new = [token]
        while True:
            still = torch.tensor(float(len(new) < wanted))
            if float(self.trainer.strategy.reduce(still, reduce_op="sum")) == 0:
                break
            out = self.model(token, cache=cache, use_cache=True)  # finished ranks call too
            cache, token = out.cache, out.logits[:, -1:].argmax(-1)
            if len(new) < wanted:
                new.append(token)
        self.generated.append(torch.cat(new, dim=1).tolist())

    def predict_step(self, batch, batch_idx):
        return self.model.generate(
            batch, attention_mask=torch.ones_like(batch), max_new_tokens=1 + 2 * self.global_rank, do_sample=False,
            synced_gpus=True, pad_token_id=0,
        ).tolist()  # fmt: skip


def trainer(strategy, **kwargs) -> pl.Trainer:
    if strategy == "zero3":
        strategy = lightning_zero3.Zero3Strategy(persistence_threshold=0)
    return pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, **kwargs,
    )  # fmt: skip


def gather(module: pl.LightningModule, value):
    everyone = [None] * module.trainer.world_size
    torch.distributed.all_gather_object(everyone, value)
    return everyone


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    data = DataLoader(PROMPTS, batch_size=2)
    for strategy in ("zero3", "ddp"):
        module = Mixtral()
        run = trainer(strategy, limit_val_batches=2, limit_predict_batches=2)
        run.validate(module, data, verbose=False)
        predicted = run.predict(module, data)
        generated = gather(module, module.generated)
        predicted = gather(module, predicted)
        if run.is_global_zero:
            torch.save({"generated": generated, "predicted": predicted}, args.out / f"generate-{strategy}.pt")
    steps = DataLoader(torch.randint(0, CONFIG["vocab_size"], (16, 8), generator=torch.Generator().manual_seed(5)),
                       batch_size=2)  # fmt: skip
    for optimizer in ("sgd", "adamw"):
        for strategy in ("zero3", "ddp_find_unused_parameters_true"):
            module = Mixtral(optimizer)
            run = trainer(strategy, max_steps=4)
            run.fit(module, steps)
            engine = lightning_zero3.engine_of(module)  # zero3 stays sharded after fit: gather the masters
            weights = engine.full_state_dict() if engine is not None else module.state_dict()
            if run.is_global_zero:
                weights = {k: v.detach().clone() for k, v in weights.items()}
                torch.save({"losses": module.losses, "weights": weights}, args.out / f"train-{strategy}-{optimizer}.pt")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
