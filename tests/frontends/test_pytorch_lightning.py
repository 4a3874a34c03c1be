"""The ``pytorch_lightning`` flavour ([Note: two Lightnings] in frontends/registration.py) with a real
``pytorch_lightning.LightningModule``: one process, a model built on the meta device through
``configure_model``, trained to the same losses as Lightning's own single-device strategy."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pytorch_lightning = pytest.importorskip("pytorch_lightning")

from lightning_zero3.frontends.shared_setup import init_hook  # noqa: E402

STEPS = 4


class _Regression(pytorch_lightning.LightningModule):
    """Two linear layers built in ``configure_model`` (on the meta device under zero3, whose construction
    rank 0 replays: the same weights as built eagerly from the same seed)."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []
        self.net = None

    def configure_model(self) -> None:
        if self.net is None:
            self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(strategy) -> _Regression:
    torch.manual_seed(1)
    x = torch.randn(8 * STEPS, 8)
    data = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8)
    pytorch_lightning.seed_everything(0)
    module = _Regression()
    trainer = pytorch_lightning.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_steps=STEPS, logger=False, use_distributed_sampler=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, data)
    return module


def test_a_pytorch_lightning_module_trains_under_the_zero3_name_as_under_its_own_strategy():
    zero3 = _fit("zero3")
    assert type(zero3.trainer.strategy).__module__ == "lightning_zero3.frontends.trainer._pl_strategy"
    assert type(zero3.trainer.precision_plugin).__module__ == "lightning_zero3.frontends.trainer._pl_precision"
    assert len(zero3.losses) == STEPS
    assert zero3.losses == pytest.approx(_fit("auto").losses, rel=1e-6, abs=0)


def test_a_pytorch_lightning_modules_init_weights_must_take_the_module():
    """As for ``lightning.pytorch``'s LightningModule (tests/frontends/test_fabric.py): its ``init_weights`` is the
    Trainer's hook, so a signature without the module is an error, not silently skipped."""

    class Wrong(pytorch_lightning.LightningModule):
        def init_weights(self):
            pass

    class Hooked(pytorch_lightning.LightningModule):
        def init_weights(self, module):
            pass

    with pytest.raises(TypeError, match="init_weights` must take one argument"):
        init_hook(Wrong())
    hooked = Hooked()
    assert init_hook(hooked) == hooked.init_weights
