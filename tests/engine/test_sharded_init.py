"""Sharded initialisation: meta-device models materialised unit by unit into shards, trained like DDP."""

from __future__ import annotations

import copy

import pytest
import torch
from benchmark_init import measure
from distributed import run_ranks
from gpt import GPT, GPTConfig
from test_engine import train_side_by_side
from torch import nn

from lightning_zero3 import Zero3Config, Zero3Engine

CFG = GPTConfig(vocab_size=128, block_size=32, n_layer=4, n_head=4, n_embd=128)


def _meta_case(rank: int, world: int) -> dict:
    torch.manual_seed(100 + rank)  # ranks draw different numbers: rank 0's initialisation must win
    with torch.device("meta"):
        model = GPT(CFG)
    engine = Zero3Engine(
        model, Zero3Config(persistence_threshold=10_000), device=torch.device("cpu"), init_fn=GPT._init
    )
    start = engine.full_state_dict()
    reference = GPT(CFG)
    reference.load_state_dict(start)
    ddp = nn.parallel.DistributedDataParallel(reference)
    opts = [torch.optim.AdamW(ddp.parameters()), engine.shard_optimizer(torch.optim.AdamW(model.parameters()))]
    losses = train_side_by_side((ddp, model), opts, rank, world, cfg=CFG)
    return {
        "start": start,
        "losses": losses,
        "tied": model.head.weight is model.wte.weight,
        "report": engine.memory_report(),
        "meta_left": [n for n, p in model.named_parameters() if p.is_meta],
    }


def test_a_meta_model_is_initialised_by_rank_0_and_trains_like_ddp():
    results = run_ranks(_meta_case, 2)
    for name, value in results[0]["start"].items():
        assert torch.equal(value, results[1]["start"][name]), name  # one model, whatever each rank drew
    start = results[0]["start"]
    assert torch.equal(start["blocks.0.ln_1.weight"], torch.ones(CFG.n_embd))  # reset_parameters()
    assert torch.equal(start["blocks.0.attn.bias"], torch.zeros(3 * CFG.n_embd))  # init_fn: zeros
    assert start["blocks.0.fc.weight"].std().item() == pytest.approx(0.02, rel=0.1)  # init_fn: std 0.02
    for result in results:
        assert result["tied"] and not result["meta_left"]
        for ddp_loss, zero3_loss in result["losses"]:
            assert zero3_loss == ddp_loss  # bitwise, as for models built whole
        assert result["report"]["gathered_params"] == 0


def test_peak_rss_while_initialising_stays_within_1_2x_the_shard_bytes():
    """200M parameters on 2 ranks (``examples/benchmarks/benchmark_init.py`` runs the same at 1B for the README)."""
    rows = measure(n_layer=16, n_embd=1024, n_head=16, world=2)
    params = rows[0]["params"]
    assert params > 200_000_000
    for row in rows:
        # parameter and gradient shards in fp32: 8 bytes per parameter / 2 ranks (plus padding and the
        # small persistent parameters every rank keeps whole)
        assert row["shard_bytes"] == pytest.approx(8 * params / 2, rel=0.01)
        assert row["peak"] - row["baseline"] <= 1.2 * row["shard_bytes"]
        assert row["peak"] - row["baseline"] < 8 * params / 2 * 1.2  # far from a full copy (8 * params)


def test_meta_buffers_are_materialised_and_broadcast():
    results = run_ranks(_buffer_case, 2)
    assert torch.equal(results[0], results[1])
    assert torch.equal(results[0], torch.arange(8.0))


class WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("positions", torch.empty(8))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.positions.copy_(torch.arange(8.0) + torch.distributed.get_rank())  # differs on each rank

    def forward(self, x):
        return self.linear(x) + self.positions


def _buffer_case(rank: int, world: int) -> torch.Tensor:
    with torch.device("meta"):
        model = WithBuffer()
    Zero3Engine(model, Zero3Config(persistence_threshold=0), device=torch.device("cpu"))
    return copy.deepcopy(model.positions)
