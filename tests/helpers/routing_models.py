"""Models whose execution depends on the data or on a draw: mixture of experts, skipped layers.

Shared by the routing tests (engine level) and their spawned ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Expert(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class MoELayer(nn.Module):
    """Tokens routed to their top-k experts by a learned gate; an expert no token chose is not run, so its
    parameters get no gradient on that rank (as in real MoE implementations)."""

    def __init__(self, dim: int, hidden: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(Expert(dim, hidden) for _ in range(experts))
        self.norm = nn.LayerNorm(dim)
        self.used: set[int] = set()  # experts run in the last forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x).reshape(-1, x.shape[-1])
        weights, chosen = F.softmax(self.gate(h), dim=-1).topk(self.top_k, dim=-1)
        out = torch.zeros_like(h)
        self.used = set()
        for index, expert in enumerate(self.experts):
            hit = chosen == index
            rows = hit.any(-1).nonzero().squeeze(-1)
            if rows.numel() == 0:
                continue
            self.used.add(index)
            weight = (weights * hit).sum(-1)[rows]
            out = out.index_add(0, rows, expert(h[rows]) * weight[:, None])
        return x + out.view_as(x)


class MoEModel(nn.Module):
    """Embedding, ``layers`` MoE layers (the units), a tied head."""

    def __init__(self, vocab=32, dim=16, hidden=32, layers=4, experts=4, top_k=1) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(MoELayer(dim, hidden, experts, top_k) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(F.gelu(self.fc(self.norm(x))))


class SkippingModel(nn.Module):
    """A stack of equal blocks; ``skip`` (a set of indices) leaves some out of this forward."""

    def __init__(self, vocab=32, dim=16, layers=4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)
        self.skip: set[int] = set()
        self.order: list[int] | None = None  # run the blocks in this order instead

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for index in self.order or range(len(self.blocks)):
            if index not in self.skip:
                h = self.blocks[index](h)
        return self.head(h)


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


class TwoTowers(nn.Module):
    """A deep tower of blocks over embeddings and a wide tower of MoE layers over fixed features of the
    tokens: the wide tower's first unit has no input that needs a gradient (no post-backward signal), and
    its backward runs before the deep tower's (it ran later in forward)."""

    def __init__(self, vocab=32, dim=16, experts=4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.deep = nn.ModuleList(Block(dim) for _ in range(2))
        self.wide = nn.ModuleList(MoELayer(dim, 2 * dim, experts, top_k=1) for _ in range(2))
        self.register_buffer("features", torch.randn(vocab, dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        deep = self.embed(tokens)
        for block in self.deep:
            deep = block(deep)
        wide = self.features[tokens]
        for layer in self.wide:
            wide = layer(wide)
        return self.head(deep + wide)
