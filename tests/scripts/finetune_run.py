"""The fine-tuning jobs (``examples/configs/finetune_{full,lora}.yaml``) through ``lightning-zero3 fit``,
under zero3 and under DDP, on 2 CPU processes; each rank writes ``OUT/rank<R>.json``.

Every run starts from the same small checkpoint (bf16 safetensors, written by ``save_pretrained``) and
exports to ``OUT/<variant>-<strategy>/``. Recorded per run: this rank's loss of every step, the loss of
the pretrained model itself (``from_pretrained``) on the first batch, and for zero3 which units train
and how many optimizer-state elements this rank holds against the adapters' size.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import lightning_zero3  # noqa: E402
from examples.finetune import TinyLlama, make_pretrained  # noqa: E402
from lightning_zero3.cli import build_cli  # noqa: E402

SHAPE = TinyLlama(hidden_size=64, intermediate_size=160, num_hidden_layers=3, max_position_embeddings=64)


def run(variant: str, strategy: str, out: Path, checkpoint: Path, adapter: Path) -> dict:
    # zero3 with small units, so that the model has sharded units beside the persistent group
    chosen = ["--trainer.strategy", "ddp"] if strategy == "ddp" else [
        "--trainer.strategy", "lightning_zero3.Zero3Strategy", "--trainer.strategy.persistence_threshold", "1000"
    ]  # fmt: skip
    args = [
        "fit", "--config", str(ROOT / "examples" / "configs" / f"finetune_{variant}.yaml"), *chosen,
        "--trainer.max_steps", "4", "--trainer.limit_val_batches", "0",
        "--trainer.logger.init_args.save_dir", str(out / "logs"), "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false", "--trainer.callbacks", "[]",
        "--model.init_args.checkpoint", str(checkpoint), "--model.init_args.make_checkpoint", "null",
        "--model.init_args.export_dir", str(out / f"{variant}-{strategy}"),
        "--data.init_args.block_size", "32", "--data.init_args.batch_size", "4", "--data.init_args.corpus_bytes", "60000",
    ]  # fmt: skip
    if variant == "lora":
        args += ["--model.init_args.lora.adapter", str(adapter)]
    cli = build_cli(args)
    module, trainer = cli.model, cli.trainer
    from transformers import AutoModelForCausalLM

    pretrained = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    ids, targets = module.first_batch
    with torch.no_grad():
        logits = pretrained(input_ids=ids).logits
    result = {
        "losses": module.step_losses,
        "pretrained_loss": torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).item(),
    }  # fmt: skip
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
    # rank 1 starts once rank 0 has written both (at the first Trainer's launch)
    checkpoint = make_pretrained(str(out / "pretrained"), SHAPE)
    adapter = initial_adapter(checkpoint, out / "initial-adapter")
    results = {f"{v}-{s}": run(v, s, out, checkpoint, adapter) for v in ("full", "lora") for s in ("zero3", "ddp")}
    rank = torch.distributed.get_rank()
    (out / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
