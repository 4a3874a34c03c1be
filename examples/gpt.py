"""A small GPT-style language model: the model the README's main job and the tests train.

``GPT`` is plain torch. ``GPTModule`` is its LightningModule (AdamW with a weight-decay split, optional
tied embeddings, optional activation checkpointing). ``random_tokens`` makes a deterministic toy
corpus for tests and benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import TensorDataset


@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    tie_embeddings: bool = True
    activation_checkpointing: bool = False


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.fc_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.wte.weight
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            if self.cfg.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class GPTModule(pl.LightningModule):
    """A byte- or token-level GPT language model.

    Args:
        cfg: The model's shape.
        lr: AdamW's learning rate.
        weight_decay: AdamW's weight decay, applied to matrices only.
        sharded_init: Build the GPT in ``configure_model`` instead of ``__init__``: under zero3 it is then
            created on the meta device and materialised unit by unit straight into shards.
    """

    def __init__(
        self, cfg: GPTConfig | None = None, lr: float = 1e-3, weight_decay: float = 0.1, sharded_init: bool = False
    ) -> None:
        super().__init__()
        self.cfg = cfg or GPTConfig()
        self.lr = lr
        self.weight_decay = weight_decay
        self.model = None if sharded_init else GPT(self.cfg)

    def configure_model(self) -> None:
        if self.model is None:
            self.model = GPT(self.cfg)

    def init_weights(self, module: nn.Module) -> None:
        """GPT's own init, for modules that zero3 materialises from the meta device."""
        GPT._init(module)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def training_step(self, batch, batch_idx):
        loss = self.model.loss(*batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model.loss(*batch), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.model.loss(*batch), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self):
        # weight decay on matrices only: a split by parameter group, as most GPT recipes do
        decay = [p for n, p in self.named_parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for n, p in self.named_parameters() if p.requires_grad and p.dim() < 2]
        return torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.lr,
        )


def apply_fsdp2(gpt: GPT, mesh) -> None:
    """torch FSDP2 over a GPT, as the benchmarks run it: one unit per block, the rest in the root."""
    from torch.distributed.fsdp import fully_shard

    for block in gpt.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(gpt, mesh=mesh)


def random_tokens(n_samples: int, block_size: int, vocab_size: int, seed: int = 0) -> TensorDataset:
    """A deterministic corpus of token sequences with some structure (so losses fall), as inputs/targets."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, vocab_size, (n_samples, 1), generator=g)
    steps = torch.randint(1, 4, (n_samples, 1), generator=g)
    seq = (base + steps * torch.arange(block_size + 1)) % vocab_size
    noise = torch.rand(seq.shape, generator=g) < 0.1
    seq = torch.where(noise, torch.randint(0, vocab_size, seq.shape, generator=g), seq)
    return TensorDataset(seq[:, :-1].contiguous(), seq[:, 1:].contiguous())


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


__all__ = ["GPT", "GPTConfig", "GPTModule", "apply_fsdp2", "random_tokens", "count_parameters"]
