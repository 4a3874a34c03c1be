"""The fp16 loss scaler: unscale and overflow check on the gradients' device, one host read per step."""

from __future__ import annotations

import pytest
import torch

from lightning_zero3.engine.comm import Communicator
from lightning_zero3.engine.scaler import ShardedLossScaler


def _grads(*values) -> list[torch.Tensor]:
    params = []
    for value, dtype in values:
        p = torch.nn.Parameter(torch.zeros(len(value), dtype=dtype))
        p.grad = torch.tensor(value, dtype=dtype)
        params.append(p)
    return params


@pytest.mark.parametrize("poisoned", [False, True])
def test_scaler_unscales_and_checks_without_a_host_read_per_gradient(monkeypatch, poisoned):
    bad = float("inf") if poisoned else 8.0
    params = _grads(([4.0, 8.0], torch.float32), ([16.0], torch.float32), ([2.0, bad], torch.bfloat16))
    params.append(torch.nn.Parameter(torch.zeros(3)))  # no gradient: left alone
    reads = []
    for name in ("item", "__bool__", "tolist"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _real=real, _n=name: reads.append(_n) or _real(self, *a))
    found = ShardedLossScaler(init_scale=4.0).unscale_and_check(params, Communicator())
    monkeypatch.undo()
    assert reads == ["item"]  # one read for the whole step (the old loop read once per gradient)
    assert found is poisoned
    assert params[0].grad.tolist() == [1.0, 2.0] and params[1].grad.tolist() == [4.0]
    assert params[2].grad[0].item() == 0.5 and params[2].grad.dtype == torch.bfloat16
