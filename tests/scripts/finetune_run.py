"""The fine-tuning jobs (``examples/configs/finetune_{full,lora}.yaml``) through ``lightning-zero3 fit`` on 2
CPU processes, on a jsonl file of instruction, chat and text rows; each rank writes ``OUT/rank<R>.json``.

  full-zero3, full-ddp, lora-zero3, lora-ddp   STEPS steps each from the same small checkpoint (bf16
        safetensors and a subword tokenizer, written by ``make_pretrained``), exported to ``OUT/<run>/``;
        LoRA with new adapters (peft's init, seed 0); DDP loads with ``from_pretrained`` (reference_loads.py);
        the full runs on packed rows (``packing: true``), the LoRA runs in length-grouped batches.
  adapter-zero3, adapter-ddp   LoRA from a saved adapter (``--model.init_args.lora.adapter``).
  interrupted   full under zero3 with max_steps STEPS, stopped after STEPS // 2 (mid-epoch), a sharded
        ``last.ckpt`` written there by ModelCheckpoint; resumed: the same job with ``--ckpt_path last``.
Recorded per run: this rank's loss of every step, ``torch.rand`` right after the load, the loss of the
pretrained model itself (``from_pretrained``) on the first batch, each row of it run alone and normalised as
the module does (over the trained tokens of all ranks), and for zero3 which units train and how many
optimizer-state elements this rank holds; and the checkpoint's files' digests before and after (the
checkpoint given is never written to).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import lightning_zero3  # noqa: E402
from examples.finetune import IGNORE, TinyLlama, make_pretrained  # noqa: E402
from examples.finetune_assets import write_sample_data  # noqa: E402
from lightning_zero3.cli import build_cli  # noqa: E402
from reference_loads import from_pretrained_reference  # noqa: E402

SHAPE = TinyLlama(hidden_size=64, intermediate_size=160, num_hidden_layers=3, max_position_embeddings=128)
STEPS = 6  # resumed mid-epoch (5 batches an epoch), the 6th step in the second epoch
# 22 training rows in 9 packs of up to 80 tokens (2 or 3 rows each), 1 pack a batch; LoRA: 2 rows a batch
DATA = {"full": ["--data.init_args.packing", "true", "--data.init_args.max_length", "80", "--data.init_args.batch_size", "1"],
        "lora": ["--data.init_args.group_by_length", "true", "--data.init_args.batch_size", "2"]}  # fmt: skip


class StopAfter(pl.Callback):
    """Ends ``fit`` after ``steps`` optimizer steps, as if the job were killed there (the LR schedule is
    still the one of ``max_steps``); ModelCheckpoint, which runs after it, has written that step."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step >= self.steps:
            trainer.should_stop = True


def digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


def args_for(variant: str, strategy: str, out: Path, checkpoint: Path, data: Path, export: str, callbacks: list) -> list:
    # zero3 with small units, so that the model has sharded units beside the persistent group
    chosen = ["--trainer.strategy", "ddp"] if strategy == "ddp" else [
        "--trainer.strategy", "lightning_zero3.Zero3Strategy", "--trainer.strategy.persistence_threshold", "1000"
    ]  # fmt: skip
    return [
        "fit", "--config", str(ROOT / "examples" / "configs" / f"finetune_{variant}.yaml"), *chosen,
        "--trainer.max_steps", str(STEPS), "--trainer.limit_val_batches", "0",
        "--trainer.logger.init_args.save_dir", str(out / "logs"), "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false", "--trainer.callbacks", json.dumps(callbacks),
        "--model.init_args.checkpoint", str(checkpoint), "--model.init_args.export_dir", str(out / export),
        "--data.init_args.path", str(data), *DATA[variant],
    ]  # fmt: skip


def rows_of(batch: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (ids, labels) of each row of a padded batch, or of each row of a packed one (where its position
    ids restart), without padding."""
    if "position_ids" not in batch:
        mask = batch["attention_mask"].bool()
        return [(ids[m], labels[m]) for ids, labels, m in zip(batch["input_ids"], batch["labels"], mask)]
    rows = []
    for ids, labels, positions in zip(batch["input_ids"], batch["labels"], batch["position_ids"]):
        starts = [*(positions == 0).nonzero().flatten().tolist(), len(ids)]
        rows += [(ids[a:b], labels[a:b]) for a, b in zip(starts, starts[1:]) if (labels[a:b] != IGNORE).any()]
    return rows


def pretrained_loss(checkpoint: Path, batch: dict) -> float:
    """The pretrained model's loss on this rank's batch, each row run alone: the rows' summed token losses
    over the trained tokens of every rank, times the world size (what ``CausalLMFineTune.batch_loss``
    computes)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    total, count = torch.zeros(()), torch.zeros((), dtype=torch.long)
    for ids, labels in rows_of(batch):
        with torch.no_grad():
            logits = model(input_ids=ids[None]).logits[0]
        total += torch.nn.functional.cross_entropy(logits[:-1], labels[1:], ignore_index=IGNORE, reduction="sum")
        count += (labels[1:] != IGNORE).sum()
    torch.distributed.all_reduce(count)
    return (total * torch.distributed.get_world_size() / count).item()


def run(variant: str, strategy: str, out: Path, checkpoint: Path, data: Path, adapter: Path) -> dict:
    args = args_for("full" if variant == "full" else "lora", strategy, out, checkpoint, data, f"{variant}-{strategy}", [])
    if variant == "adapter":
        args += ["--model.init_args.lora.adapter", str(adapter)]
    if strategy == "ddp":
        with from_pretrained_reference():
            cli = build_cli(args)
    else:
        cli = build_cli(args)
    module, trainer = cli.model, cli.trainer
    result = {"losses": module.step_losses, "pretrained_loss": pretrained_loss(checkpoint, module.first_batch),
              "first_batch": {"rows": len(rows_of(module.first_batch)), "shape": list(module.first_batch["input_ids"].shape)},
              "items": [len(item) if isinstance(item, list) else 1 for item in cli.datamodule.train],  # rows a pack
              "rand_after_load": module.rand_after_load}  # fmt: skip
    if variant == "full":  # the trained weights, gathered, to hold the export against
        with lightning_zero3.gathered_parameters(module.model):
            trained = {name: value.detach().clone() for name, value in module.model.state_dict().items()}
        if torch.distributed.get_rank() == 0:
            torch.save(trained, out / f"{variant}-{strategy}" / "trained.pt")
    engine = getattr(trainer.strategy, "engine", None)
    if engine is not None:
        result["trainable_units"] = [rt.name for rt in engine.runtimes if rt.group.trainable]
        optimizer = trainer.optimizers[0]
        result["state_elements"] = sum(
            v.numel() for s in optimizer.state.values() for k, v in s.items() if torch.is_tensor(v) and k != "step"
        )  # fmt: skip
        result["adapter_elements"] = sum(p.numel() for p in module.parameters() if p.requires_grad)
    return result


def interrupted_and_resumed(out: Path, checkpoint: Path, data: Path) -> dict:
    saver = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
             "init_args": {"dirpath": str(out / "resume" / "checkpoints"), "every_n_train_steps": STEPS // 2,
                           "save_top_k": 0, "save_last": True}}  # fmt: skip
    args = args_for("full", "zero3", out, checkpoint, data, "resume/export", [saver])
    cli = build_cli(args[1:], run=False)  # no subcommand: fit is called below, with the stop added
    cli.trainer.callbacks.insert(0, StopAfter(STEPS // 2))
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    first = cli.model.step_losses
    resumed = build_cli([*args, "--ckpt_path", "last"])  # what a user types to resume
    written = sorted(p.name for p in (out / "resume" / "checkpoints").iterdir())
    return {"interrupted": first, "resumed": resumed.model.step_losses, "checkpoints": written,
            "global_step": resumed.trainer.global_step}  # fmt: skip


def initial_adapter(checkpoint: Path, out: Path) -> Path:
    """New LoRA adapters for the pretrained model (peft's own init: B = 0) saved with peft's
    ``save_pretrained``: both strategies' LoRA runs start from them."""
    if not out.exists():
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        from examples.finetune import LoraSettings

        torch.manual_seed(1)
        lora = LoraSettings()
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, target_modules=lora.target_modules)
        get_peft_model(model, config).save_pretrained(out)
    return out


def main() -> None:
    out = Path(sys.argv[1])
    # rank 1 starts once rank 0 has written these (at the first Trainer's launch)
    checkpoint = make_pretrained(str(out / "pretrained"), SHAPE)
    data = out / "data.jsonl"
    if not data.exists():
        write_sample_data(data)
    adapter = initial_adapter(checkpoint, out / "initial-adapter")
    before = digests(checkpoint)
    variants = ("full", "lora", "adapter")
    results = {f"{v}-{s}": run(v, s, out, checkpoint, data, adapter) for v in variants for s in ("zero3", "ddp")}
    results["resume"] = interrupted_and_resumed(out, checkpoint, data)
    results["checkpoint_unchanged"] = digests(checkpoint) == before
    rank = torch.distributed.get_rank()
    (out / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
