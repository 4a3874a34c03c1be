"""One process (world size 1): nothing to shard, so every unit stays gathered for the whole run (no gather,
release or re-gather), the optimizer steps the buffer the model computes with, and training reproduces
the model trained without zero3 (see [Note: one process keeps its units gathered] in engine/shard/flat_group.py)."""

from __future__ import annotations

import collections
import contextlib
import copy
import math

import lightning.pytorch as pl
import pytest
import torch
from gpt import GPT, GPTConfig, GPTModule, random_tokens
from lightning.pytorch.loggers.logger import Logger
from torch.utils.data import DataLoader

from lightning_zero3 import Zero3Config, Zero3Engine, Zero3Strategy
from lightning_zero3.engine.grads import reduction as grads
from lightning_zero3.engine.layout.slots import DtypePolicy

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32)
STEPS = 4


def _train(model: torch.nn.Module, engine: Zero3Engine | None = None) -> tuple[list[float], torch.optim.Optimizer]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if engine is not None:
        engine.shard_optimizer(optimizer)
    x, y = random_tokens(8 * STEPS, CFG.block_size, CFG.vocab_size).tensors
    losses = []
    for step in range(STEPS):
        loss = model.loss(x[8 * step : 8 * step + 8], y[8 * step : 8 * step + 8])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, optimizer


@pytest.fixture(scope="module")
def runs():
    torch.manual_seed(0)
    plain = GPT(CFG)
    out = {"initial": copy.deepcopy(plain.state_dict())}
    out["plain"] = _train(plain)[0], plain
    for name, settings, dtypes in (
        ("alone", {}, DtypePolicy()),
        ("sharded", {"single_process_sharding": True}, DtypePolicy()),
        ("alone-bf16", {}, DtypePolicy(compute=torch.bfloat16)),
        ("sharded-bf16", {"single_process_sharding": True}, DtypePolicy(compute=torch.bfloat16)),
        ("alone-offload", {"offload_optimizer": "cpu"}, DtypePolicy()),
    ):
        model = GPT(CFG)
        model.load_state_dict(out["initial"])
        engine = Zero3Engine(model, Zero3Config(persistence_threshold=100, tune_collectives=False, **settings),
                             dtypes=dtypes)  # fmt: skip
        with _counting_packs() as packs:
            losses, optimizer = _train(model, engine)
        out[name] = {"losses": losses, "engine": engine, "model": model, "optimizer": optimizer, "packs": packs}
    return out


@contextlib.contextmanager
def _counting_packs():
    """Counts, per group name, the gradients packed by copying: a staging buffer filled parameter by
    parameter ("copied"), or a gradient autograd did not leave in its landing view ("strays")."""
    counts: collections.Counter = collections.Counter()
    copies, strays = grads._pack_copies, grads._strays

    def counting_copies(buffer, group, used, divisor):
        counts["copied", group.name] += 1
        return copies(buffer, group, used, divisor)

    def counting_strays(group, landing, used):
        found = strays(group, landing, used)
        counts["strays", group.name] += len(found)
        return found

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(grads, "_pack_copies", counting_copies)
        patch.setattr(grads, "_strays", counting_strays)
        yield counts


def test_one_process_keeps_every_unit_gathered_and_gathers_nothing(runs):
    engine = runs["alone"]["engine"]
    assert len(engine.runtimes) == CFG.n_layer + 2  # the root, the blocks, the persistent group
    for runtime in engine.runtimes:
        group = runtime.group
        assert group.gathered and group.stays_gathered
        assert group.gathers == 0  # not one copy in four steps: the shard is the full buffer
        assert group.shard.data_ptr() == group.full.data_ptr()
    report = engine.memory_report()
    assert report["param_shards"] == report["peak_param_shards"] == 0  # no second copy of the weights
    assert report["gathered_params"] + report["persistent_params"] == 4 * sum(p.numel() for p in GPT(CFG).parameters())
    # gathered at any time: the weights are readable outside forward, as the trained values
    model = runs["alone"]["model"]
    torch.testing.assert_close(model.head.weight, runs["plain"][1].head.weight, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["alone", "sharded", "alone-bf16", "alone-offload"])
def test_one_process_reduces_its_gradients_without_a_collective_and_gives_every_buffer_back(runs, name):
    # [Note: one rank reduces nothing]: the packed row is the sum, accumulated straight into the shard
    engine = runs[name]["engine"]
    assert engine.comm.stats["reduce_scatter"].count == 0
    pools = {id(rt.group.pool): rt.group.pool for rt in engine.runtimes}
    assert len(pools) == 1
    (pool,) = pools.values()
    assert pool.idle_bytes == engine.ledger.held[pool.category] > 0  # every packed buffer back in the pool


@pytest.mark.parametrize("name", ["alone", "sharded", "alone-bf16", "sharded-bf16", "alone-offload"])
def test_every_group_reduces_the_buffer_its_gradients_landed_in(runs, name):
    # [Note: the persistent group lands when backward begins] in engine/schedule/hooks.py, and with a bf16 compute dtype
    # [Note: one rank accumulates its landing buffer] in engine/grads/reduction.py: nothing is packed by copying
    engine, packs = runs[name]["engine"], runs[name]["packs"]
    assert engine.persistent is not None and engine.persistent.trainable
    assert dict(packs) == {("strays", rt.group.name): 0 for rt in engine.runtimes if rt.trainable}


def test_units_are_released_as_with_several_ranks_when_sharding_is_asked_for(runs):
    engine = runs["sharded"]["engine"]
    units = [rt.group for rt in engine.runtimes if not rt.group.persistent]
    assert not any(g.gathered or g.stays_gathered for g in units)  # released after the last backward
    *blocks, last = units[1:]
    assert all(g.gathers == 2 * STEPS for g in blocks)  # forward and backward, every step
    # the last block's backward comes right after its forward: kept for it once the order is recorded
    assert last.gathers == STEPS + 1


def test_one_process_trains_as_the_plain_model(runs):
    plain, _ = runs["plain"]
    assert runs["alone"]["losses"] == pytest.approx(plain, rel=1e-6, abs=0)
    assert runs["alone"]["losses"] == runs["sharded"]["losses"]  # both ways compute the same thing
    assert runs["alone-offload"]["losses"] == pytest.approx(plain, rel=1e-6, abs=0)
    c = CFG.n_embd
    for name in ("alone", "alone-offload"):
        for (key, mine), theirs in zip(runs[name]["model"].state_dict().items(), runs["plain"][1].state_dict().values()):
            if key.endswith("attn.bias"):
                # the key's bias gets a gradient of rounding noise only (softmax ignores a shift of every
                # score), which Adam scales up to steps of lr: the host optimizer's kernel (offload) rounds
                # that noise differently. Its query and value parts must match.
                mine, theirs = torch.cat([mine[:c], mine[2 * c :]]), torch.cat([theirs[:c], theirs[2 * c :]])
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6, msg=f"{name}: {key}")


def test_a_lower_compute_dtype_is_cast_once_per_step_and_trains_as_sharding_does(runs):
    alone, sharded = runs["alone-bf16"], runs["sharded-bf16"]
    assert alone["losses"] == sharded["losses"]  # the same bf16 copies of the same fp32 masters
    for runtime in alone["engine"].runtimes:
        group = runtime.group
        assert group.gathered and group.full.dtype == torch.bfloat16 and group.shard.dtype == torch.float32
        assert group.gathers == STEPS  # cast from the master after each step, never per forward or backward


def test_optimizer_state_stays_where_the_offload_settings_put_it(runs):
    run = runs["alone-offload"]
    groups = [rt.group for rt in run["engine"].runtimes]
    assert all(g.stays_gathered and g.store is not None for g in groups)
    for group in groups:  # the optimizer steps the host tier's master; the model computes with its own copy
        assert group.master is group.store.master and group.master.data_ptr() != group.full.data_ptr()
    assert run["engine"].memory_report()["offload_host"] > 0
    # parameters offloaded: read from their tier per use, so units are released as with several ranks
    engine = Zero3Engine(GPT(CFG), Zero3Config(offload_optimizer="cpu", offload_params="cpu", tune_collectives=False))
    assert not any(rt.group.stays_gathered for rt in engine.runtimes)


class _Recorded(GPTModule):
    def __init__(self) -> None:
        super().__init__(CFG)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.item())
        return loss


def _fit(strategy) -> list[float]:
    pl.seed_everything(0)
    module = _Recorded()
    # a distributed strategy's Trainer shuffles the training data (its DistributedSampler); the same batches here
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=STEPS, logger=False,
                         use_distributed_sampler=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)  # fmt: skip
    trainer.fit(module, DataLoader(random_tokens(8 * STEPS, CFG.block_size, CFG.vocab_size), batch_size=8))
    return module.losses


def test_a_one_device_trainer_trains_as_lightnings_own_single_device_strategy(monkeypatch):
    calls = []
    for name in ("barrier", "all_reduce"):
        real = getattr(torch.distributed, name)
        monkeypatch.setattr(torch.distributed, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    zero3 = _fit(Zero3Strategy(persistence_threshold=100, tune_collectives=False))
    # [Note: one process syncs nothing]: the loss logged with sync_dist=True every step, no barrier or all-reduce
    assert calls == []
    monkeypatch.undo()
    assert zero3 == pytest.approx(_fit("auto"), rel=1e-6, abs=0)


class _Clipped(_Recorded):
    """Records the global gradient norm before clipping (one process: its shards hold the whole gradient),
    and makes the loss NaN at the optimizer step ``nan_at``."""

    def __init__(self, nan_at: int) -> None:
        super().__init__()
        self.nan_at, self.norms = nan_at, []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.trainer.global_step + 1 == self.nan_at else loss

    def on_before_optimizer_step(self, optimizer) -> None:
        grads = [p.grad.reshape(-1) for p in self.trainer.strategy._engine.shard_params if p.grad is not None]
        self.norms.append(float(torch.linalg.vector_norm(torch.cat(grads))))


class _Metrics(Logger):
    """A logger that keeps what it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[dict] = []

    name = "metrics"
    version = 0

    def log_hyperparams(self, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.logged.append(dict(metrics))


def test_the_clipping_norm_is_logged_and_a_non_finite_one_is_reported_at_its_step():
    pl.seed_everything(0)
    module, logger = _Clipped(nan_at=3), _Metrics()
    trainer = pl.Trainer(strategy=Zero3Strategy(persistence_threshold=100, tune_collectives=False), accelerator="cpu",
                         devices=1, max_steps=3, logger=logger, log_every_n_steps=1, gradient_clip_val=0.05,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    with pytest.warns(UserWarning, match="the global gradient norm is nan at step 3"):
        trainer.fit(module, DataLoader(random_tokens(8 * STEPS, CFG.block_size, CFG.vocab_size), batch_size=8))
    logged = [m["zero3/grad_norm"] for m in logger.logged if "zero3/grad_norm" in m]
    assert len(logged) == 3 and logged[:2] == pytest.approx(module.norms[:2], rel=1e-5, abs=0)
    assert logged[0] > 0.05 and math.isnan(logged[2])  # clipped for real; the NaN step logged as it was
