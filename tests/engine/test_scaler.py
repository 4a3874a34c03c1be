"""fp16 unscaling and the overflow check: on the gradients' device, one host read per step."""

from __future__ import annotations

import pytest
import torch
from gpt import GPT, GPTConfig, random_tokens

from lightning_zero3 import Zero3Config, Zero3Engine
from lightning_zero3.engine.grads.gradients import unscale_


def _grads(*values) -> list[torch.Tensor]:
    return [torch.tensor(value, dtype=dtype) for value, dtype in values]


@pytest.mark.parametrize("poisoned", [False, True])
def test_unscaling_checks_every_dtype_without_asking_the_host(monkeypatch, poisoned):
    bad = float("inf") if poisoned else 8.0
    grads = _grads(([4.0, 8.0], torch.float32), ([16.0], torch.float32), ([2.0, bad], torch.bfloat16))
    found = torch.zeros(1)
    reads = []
    for name in ("item", "__bool__", "tolist"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _real=real, _n=name: reads.append(_n) or _real(self, *a))
    unscale_(grads, found, 0.25)
    monkeypatch.undo()
    assert reads == []  # the old loop read once per gradient
    assert (found.item() > 0) is poisoned
    assert grads[0].tolist() == [1.0, 2.0] and grads[1].tolist() == [4.0]
    assert grads[2][0].item() == 0.5 and grads[2].dtype == torch.bfloat16


@pytest.mark.parametrize("poisoned", [False, True])
def test_an_engine_step_reads_the_overflow_flag_once(monkeypatch, poisoned):
    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=32)
    torch.manual_seed(0)
    model = GPT(cfg)
    engine = Zero3Engine(model, Zero3Config(persistence_threshold=100))
    engine.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = random_tokens(2, cfg.block_size, cfg.vocab_size)[:2]
    logits = model(x)
    (torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size), y.reshape(-1)) * 8.0).backward()
    before = [p.grad.clone() for p in engine.shard_params if p.grad is not None]
    if poisoned:
        next(p.grad for p in engine.shard_params if p.grad is not None and p.grad.numel())[0] = float("nan")
    reads = []
    real = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda self: reads.append(1) or real(self))
    found = engine.unscale_gradients_(0.125)
    monkeypatch.undo()
    assert reads == [1] and found is poisoned
    if not poisoned:
        after = [p.grad for p in engine.shard_params if p.grad is not None]
        assert all(torch.equal(a, b * 0.125) for a, b in zip(after, before))
