"""``torch.compile`` with zero3 (CPU, inductor): blocks compiled in place in ``configure_model`` keep zero3's
hooks firing and train as the eager model does, compiled once for all blocks of one shape; a compiled
model's hooks run as Python between compiled regions; compiled code that bypasses the hooks fails with a
message that names the fix. The first test runs the ``configure_model`` that docs/fabric-litgpt.md shows."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from gpt import GPT, GPTConfig, GPTModule, random_tokens
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader

from lightning_zero3 import ParameterNotGatheredError, Zero3Config, Zero3Engine, Zero3Strategy

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32)


class BlocksCompiled(GPTModule):
    """The documented way: build the model in ``configure_model`` and compile each block in place."""

    def __init__(self, compile_blocks: bool) -> None:
        super().__init__(CFG, sharded_init=True)
        self.compile_blocks = compile_blocks
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.model is None:
            super().configure_model()
            if self.compile_blocks:
                for block in self.model.blocks:
                    block.compile()

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.item())
        return loss


def _fit(compile_blocks: bool) -> tuple[list[float], dict]:
    torch._dynamo.reset()
    counters.clear()
    pl.seed_everything(0)
    module = BlocksCompiled(compile_blocks)
    # one process shards (and gathers) as several ranks do: the hooks must fire between compiled blocks
    strategy = Zero3Strategy(persistence_threshold=100, tune_collectives=False, single_process_sharding=True)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu",
                         devices=1, max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)  # fmt: skip
    trainer.fit(module, DataLoader(random_tokens(32, CFG.block_size, CFG.vocab_size), batch_size=8))
    gathers = sum(rt.group.gathers for rt in trainer.strategy.engine.runtimes)
    return module.losses, {**dict(counters["stats"]), "frames": counters["frames"]["total"], "gathers": gathers}


@pytest.fixture(scope="module")
def fits():
    return {"eager": _fit(False), "blocks": _fit(True)}


def test_blocks_compiled_in_place_train_as_the_eager_model_with_the_hooks_firing(fits):
    eager, _ = fits["eager"]
    compiled, stats = fits["blocks"]
    assert len(compiled) == 4
    assert compiled == pytest.approx(eager, rel=1e-6, abs=0)
    assert stats["gathers"] == fits["eager"][1]["gathers"] > 0  # every unit gathered as often as in eager mode


def test_blocks_of_one_shape_compile_once(fits):
    _, stats = fits["blocks"]
    assert stats["unique_graphs"] == 1 and stats["frames"] == 1  # four blocks, one graph, no recompile


def test_a_compiled_model_runs_the_hooks_between_compiled_regions_and_a_bypass_fails_clearly():
    torch.manual_seed(0)
    model = GPT(CFG)
    Zero3Engine(model, Zero3Config(persistence_threshold=100, tune_collectives=False, single_process_sharding=True))
    x, y = random_tokens(8, CFG.block_size, CFG.vocab_size).tensors
    # without gradients: a forward with them keeps the root gathered for its backward, and a bypass
    # would then compute with validly gathered weights
    with torch.no_grad():
        eager = model.loss(x, y)
        torch._dynamo.reset()
        logits = torch.compile(model)(x)  # the whole model: zero3's hooks run as Python at each unit
    torch.testing.assert_close(torch.nn.functional.cross_entropy(logits.reshape(-1, 64), y.reshape(-1)), eager,
                               rtol=1e-6, atol=0)  # fmt: skip
    with pytest.raises(Exception, match="compiled code bypasses the hooks .* Compile the modules themselves") as failure:
        torch.compile(model.forward)(x)  # the root's forward without the root's hooks: nothing gathered
    assert isinstance(failure.value, ParameterNotGatheredError) or "ParameterNotGatheredError" in str(failure.value)
