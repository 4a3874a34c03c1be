"""Lightning flows under "zero3" on CPU ranks; each rank writes what it saw to ``OUT/<mode>-rank<R>.json``.

Modes:
  flows     fit (with validation) -> validate -> test -> predict on one Trainer; sync_dist logging, the
            injected DistributedSampler, gathered_parameters inside a hook, manual optimization vs DDP.
  touch     a hook reads a sharded weight without gathered_parameters (must fail, naming the remedy).
  frozen    fit of a model with no trainable parameter (must fail before training).
  fp16      16-mixed with an inf injected into rank 1's gradient shard at step 3, vs step 3 skipped by
            construction; per-step loss scales on every rank; the scaler state in a checkpoint.
  resume    1 epoch (3 steps), save, resume for a 2nd epoch (under zero3 and DDP) vs 2 uninterrupted epochs.

``--offload cpu|nvme`` runs every zero3 Trainer with that offload (both tiers; swap files under OUT/nvme).
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import os
import sys
import traceback
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from gpt import GPTConfig, GPTModule, random_tokens  # noqa: E402

import lightning_zero3  # noqa: E402
from lightning_zero3.checkpoint import load_trainer_state  # noqa: E402

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
N_SAMPLES = 32


def indexed_data() -> TensorDataset:
    x, y = random_tokens(N_SAMPLES, CFG.block_size, CFG.vocab_size).tensors
    return TensorDataset(x, y, torch.arange(N_SAMPLES))


class FlowsGPT(GPTModule):
    def __init__(self) -> None:
        super().__init__(CFG)
        self.seen: list[int] = []
        self.block_sum: float = 0.0

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        self.seen += idx.tolist()
        self.log("rank_mean", float(self.global_rank), sync_dist=True)
        return self.model.loss(x, y)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model.loss(*batch[:2]), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.model.loss(*batch[:2]), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(-1)

    def on_train_epoch_end(self):
        with lightning_zero3.gathered_parameters(self.model.blocks[0]):
            self.block_sum = float(self.model.blocks[0].fc.weight.detach().double().sum())


class ManualGPT(GPTModule):
    def __init__(self) -> None:
        super().__init__(CFG)
        self.automatic_optimization = False
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        loss = self.model.loss(*batch[:2])
        self.manual_backward(loss)
        self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        optimizer.step()
        optimizer.zero_grad()
        self.losses.append(float(self.trainer.strategy.reduce(loss.detach(), reduce_op="mean")))


class TouchGPT(GPTModule):
    def on_train_batch_start(self, batch, batch_idx):
        self.model.blocks[1].fc.weight.sum()


def trainer(strategy, **kwargs) -> pl.Trainer:
    defaults = dict(accelerator="cpu", devices=2, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    return pl.Trainer(strategy=strategy, **{**defaults, **kwargs})


OFFLOAD: dict = {}  # offload knobs for every zero3 Trainer (--offload)
OUT = Path(".")  # the --out folder


def zero3():
    return lightning_zero3.Zero3Strategy(persistence_threshold=500, **OFFLOAD)


def flows() -> dict:
    pl.seed_everything(0)
    model = FlowsGPT()
    loader = DataLoader(indexed_data(), batch_size=4)
    t = trainer(zero3(), max_epochs=1, limit_val_batches=2)
    t.fit(model, loader, loader)
    out = {
        "seen": sorted(model.seen),
        "rank_mean": float(t.callback_metrics["rank_mean"]),
        "val_loss": float(t.callback_metrics["val_loss"]),
        "block_sum": model.block_sum,
        "sampler": type(t.train_dataloader.sampler).__name__,
    }
    out.update(after_fit(t, model, loader, out))

    manual = {}
    for name, strategy in (("zero3", zero3()), ("ddp", "ddp")):
        pl.seed_everything(0)
        module = ManualGPT()
        trainer(strategy, max_steps=6).fit(module, DataLoader(indexed_data(), batch_size=4))
        manual[name] = module.losses
    out["manual"] = manual
    out["ddp"] = after_fit_ddp(loader)
    return out


def after_fit(t: pl.Trainer, model: FlowsGPT, loader: DataLoader, out: dict) -> dict:
    """What a user does once ``fit`` returns, and what stays sharded meanwhile (compared with DDP)."""
    engine = t.strategy.engine
    report = engine.memory_report()
    n_params = sum(p.numel() for p in model.parameters())
    result = {
        "engine_kept": lightning_zero3.Zero3Engine is type(engine) and lightning_zero3.engine_of(model) is engine,
        "optimizer_state_bytes": report["optimizer_state"],
        "adam_state_bytes_unsharded": 8 * n_params,
        "gathered_after_fit": report["gathered_params"],
        "gathered_resident_after_fit": engine.gathered_resident_bytes(),
        "peak_total": report["peak_total"],
    }
    result["validate"] = t.validate(model, loader, verbose=False)[0]["val_loss"]
    result["test"] = t.test(model, loader, verbose=False)[0]["test_loss"]
    predictions = t.predict(model, DataLoader(indexed_data(), batch_size=4))
    result["predict_shapes"] = [list(p.shape) for p in predictions]
    with torch.no_grad():  # a forward call outside the Trainer, on every rank
        result["forward_outside"] = model(indexed_data().tensors[0][:2]).double().sum().item()
    result["engine_after_evaluation"] = t.strategy.engine is engine and lightning_zero3.engine_of(model) is engine
    t.save_checkpoint(OUT / "after_fit.ckpt")
    result["checkpoint_after_fit_is_sharded"] = (OUT / "after_fit.ckpt").is_dir()
    lightning_zero3.save_full_weights(model, OUT / "weights.safetensors", prefix="model.")
    with lightning_zero3.gathered_parameters(model):
        result["weights_after"] = float(sum(p.detach().double().sum() for p in model.parameters()))
        result["fc_weight"] = model.model.blocks[1].fc.weight.detach().clone().tolist()
    log = LossLog()
    trainer(zero3(), max_epochs=1, callbacks=[log]).fit(model, loader)  # a further fit, with a new Trainer
    result["second_fit_losses"] = log.losses
    return result


class GeneratingGPT(FlowsGPT):
    """validation_step: greedy generation, one model call per new token (the calls an evaluation stage
    repeats); records the tokens and the last logits."""

    NEW_TOKENS = 6

    def __init__(self) -> None:
        super().__init__()
        self.generated: list = []

    def validation_step(self, batch, batch_idx):
        tokens = batch[0][:, :4]
        for _ in range(self.NEW_TOKENS):
            logits = self(tokens)[:, -1]
            tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)
        self.generated.append((tokens.tolist(), logits.double().sum().item()))


def inference(out: Path) -> dict:
    """Validation that generates, after fit, under several inference budgets; what stays gathered, what
    was gathered per unit, the peaks against the training step's."""
    pl.seed_everything(0)
    model = GeneratingGPT()
    loader = DataLoader(indexed_data(), batch_size=4)
    t = trainer(zero3(), max_steps=3, limit_val_batches=2, num_sanity_val_steps=0, check_val_every_n_epoch=None,
                val_check_interval=None)  # fmt: skip
    t.fit(model, loader)
    engine = t.strategy.engine
    trained_peak = engine.ledger.peak_training_transient
    result: dict = {"trained_peak": trained_peak, "budgets": {}}
    model_bytes = sum(rt.group.full.numel() * rt.group.full.element_size() for rt in engine.residency.candidates)
    for name, budget in (("zero", 0), ("half", model_bytes // 2), ("full", model_bytes), ("auto", "auto")):
        model.generated = []
        before = [rt.group.gathers for rt in engine.residency.candidates]
        strategy = lightning_zero3.Zero3Strategy(persistence_threshold=500, inference_memory_budget=budget, **OFFLOAD)
        run = trainer(strategy, limit_val_batches=2)
        with engine.ledger.watch() as peaks:
            run.validate(model, loader, verbose=False)
        plan_bytes = engine.residency.last_plan_bytes
        result["budgets"][name] = {
            "budget": engine.residency.budget(),
            "generated": model.generated,
            "gathers": [rt.group.gathers - b for rt, b in zip(engine.residency.candidates, before)],
            "resident_bytes": plan_bytes,
            "peak_transient": peaks["gathered_params"] + peaks["staging_buffers"],
            "peak_gathered": peaks["gathered_params"],
            "gathered_after": engine.ledger.held["gathered_params"],
            "resident_after": engine.gathered_resident_bytes(),
        }
    result["calls"] = 2 * (GeneratingGPT.NEW_TOKENS)  # forward calls of one validation (2 batches)
    result["model_bytes"] = model_bytes
    return result


def after_fit_ddp(loader: DataLoader) -> dict:
    """The same as ``after_fit`` under DDP, for reference."""
    pl.seed_everything(0)
    model = FlowsGPT()
    t = trainer("ddp", max_epochs=1, limit_val_batches=2)
    t.fit(model, loader, loader)
    result = {"validate": t.validate(model, loader, verbose=False)[0]["val_loss"]}
    with torch.no_grad():
        result["forward_outside"] = model(indexed_data().tensors[0][:2]).double().sum().item()
    log = LossLog()
    trainer("ddp", max_epochs=1, callbacks=[log]).fit(model, loader)
    result["second_fit_losses"] = log.losses
    return result


class LossLog(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")))


class SaveBothFormats(pl.Callback):
    """At the end of the epoch (inside fit, while the model is sharded) save it in both formats."""

    def __init__(self, sharded: Path, full: Path) -> None:
        self.sharded, self.full = sharded, full

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        trainer.save_checkpoint(self.sharded)  # the default: a directory of per-rank shards
        config = trainer.strategy.config
        trainer.strategy.config = dataclasses.replace(config, checkpoint_format="full")
        trainer.save_checkpoint(self.full)  # one file of full state, which DDP reads as its own
        trainer.strategy.config = config


def resume(out: Path) -> dict:
    data = TensorDataset(*(t[:24] for t in indexed_data().tensors))
    loader = DataLoader(data, batch_size=4)  # 12 samples per rank: 3 steps per epoch
    sharded, full = out / "three_steps.ckpt", out / "three_steps_full.ckpt"
    runs = {}
    for name, strategy, epochs, ckpt in (
        ("first", zero3(), 1, None),
        ("zero3", zero3(), 2, sharded),
        ("zero3_from_full", zero3(), 2, full),
        ("ddp", "ddp", 2, full),
        ("straight", zero3(), 2, None),
    ):
        pl.seed_everything(0)
        log = LossLog()
        callbacks = [log, SaveBothFormats(sharded, full)] if name == "first" else [log]
        t = trainer(strategy, max_epochs=epochs, callbacks=callbacks)
        t.fit(FlowsGPT(), loader, ckpt_path=ckpt)
        runs[name] = log.losses
    runs["sharded_is_dir"], runs["full_is_file"] = sharded.is_dir(), full.is_file()
    return runs


INJECT_AT = 3


class Fp16GPT(FlowsGPT):
    """Records the loss scale at every step; ``mode`` says what happens at step INJECT_AT."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.scales: list[float] = []
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = self.model.loss(*batch[:2])
        self.losses.append(float(self.trainer.strategy.reduce(loss.detach(), reduce_op="mean")))
        return loss

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        if self.mode == "skip" and batch_idx == INJECT_AT:
            optimizer_closure()  # forward and backward, then no step: skipped by construction
            return
        optimizer.step(closure=optimizer_closure)

    def on_after_backward(self):
        if self.mode == "inject" and self.trainer.global_step == INJECT_AT and self.global_rank == 1:
            grad = next(p.grad for p in self.trainer.strategy.engine.shard_params if p.grad is not None and p.grad.numel())
            grad[0] = float("inf")  # one element of one rank's shard: only this rank sees it

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.scales.append(self.trainer.precision_plugin.scaler.scale)


def fp16(out: Path) -> dict:
    result = {}
    for mode in ("inject", "skip"):
        pl.seed_everything(0)
        module = Fp16GPT(mode)
        t = trainer(zero3(), max_steps=8, plugins=[lightning_zero3.Zero3Precision("16-mixed")])
        t.fit(module, DataLoader(indexed_data(), batch_size=2))
        scaler = t.precision_plugin.scaler
        result[mode] = {"losses": module.losses, "scales": module.scales, "skipped": scaler.skipped_steps}
        if mode == "inject":
            t.save_checkpoint(out / "fp16.ckpt")  # after fit: sharded, the scaler in the trainer state
            checkpoint = load_trainer_state(out / "fp16.ckpt")
            result["checkpointed_scaler"] = checkpoint.get("Zero3Precision")
    resumed = Fp16GPT("resume")
    t = trainer(zero3(), max_steps=9, plugins=[lightning_zero3.Zero3Precision("16-mixed")])
    t.fit(resumed, DataLoader(indexed_data(), batch_size=2), ckpt_path=out / "fp16.ckpt")
    result["resumed_scales"] = resumed.scales
    return result


def expect_failure(module: pl.LightningModule) -> dict:
    try:
        trainer(zero3(), max_steps=2).fit(module, DataLoader(indexed_data(), batch_size=4))
    except Exception as error:  # noqa: BLE001  (the test reads the type and message)
        return {"error_type": type(error).__name__, "error": str(error), "trace": traceback.format_exc()[-2000:]}
    return {"error_type": None}


def note_group_at_exit(out: Path, mode: str) -> None:
    """Registered before any Trainer runs, so it runs after the strategy's own exit handler (atexit is
    last-in, first-out): whether the process group is still open when the interpreter goes down."""
    rank = int(os.environ.get("LOCAL_RANK", 0))
    (out / f"{mode}-exit-rank{rank}.json").write_text(json.dumps({"group_open": torch.distributed.is_initialized()}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["flows", "touch", "frozen", "resume", "fp16", "inference"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--offload", choices=["cpu", "nvme"])
    args = parser.parse_args()
    if args.offload:
        OFFLOAD.update(offload_optimizer=args.offload, offload_params=args.offload)
        if args.offload == "nvme":
            OFFLOAD["nvme_path"] = str(args.out / "nvme")
    args.out.mkdir(parents=True, exist_ok=True)
    global OUT
    OUT = args.out
    atexit.register(note_group_at_exit, args.out, args.mode)
    pl.seed_everything(0)
    if args.mode == "flows":
        result = flows()
    elif args.mode == "fp16":
        result = fp16(args.out)
    elif args.mode == "resume":
        result = resume(args.out)
    elif args.mode == "inference":
        result = inference(args.out)
    elif args.mode == "touch":
        result = expect_failure(TouchGPT(CFG))
    else:
        frozen = GPTModule(CFG)
        frozen.requires_grad_(False)
        result = expect_failure(frozen)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.mode}-rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
