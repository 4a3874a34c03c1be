"""The multimodal job (``examples/configs/finetune_llava.yaml``) through ``lightning-zero3 fit`` on 2 CPU
processes, under zero3 and DDP (loading with ``from_pretrained``), from one tiny LLaVA-Next checkpoint
written by ``make_llava_next`` (bf16, CLIP tower, Llama, a locally trained tokenizer and the processor) on
image conversation rows with generated PNG images (``write_sample_images``); each rank writes
``OUT/rank<R>.json``: per run, this rank's loss of every step, ``torch.rand`` right after the load, which
parameters trained, and (zero3) which units train.
"""

from __future__ import annotations

import json
import sys
from contextlib import nullcontext
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from examples.finetune import TinyLlama, make_llava_next  # noqa: E402
from examples.finetune_assets import write_sample_images  # noqa: E402
from lightning_zero3.cli import build_cli  # noqa: E402
from reference_loads import from_pretrained_reference  # noqa: E402

TEXT = TinyLlama(hidden_size=64, intermediate_size=160, num_hidden_layers=2, max_position_embeddings=256)
STEPS = 4


def parts(model: torch.nn.Module, trainable: bool) -> list[str]:
    """The model's top parts (``vision_tower``, ``multi_modal_projector``, ``language_model``, ``lm_head``, ...)
    with parameters that train (or are frozen)."""
    names = {n.removeprefix("model.").split(".")[0] for n, p in model.named_parameters() if p.requires_grad == trainable}
    return sorted(names)


def run(strategy: str, out: Path, checkpoint: Path, data: Path) -> dict:
    chosen = ["--trainer.strategy", "ddp"] if strategy == "ddp" else ["--trainer.strategy.persistence_threshold", "1000"]
    with from_pretrained_reference() if strategy == "ddp" else nullcontext():  # DDP: from_pretrained
        cli = build_cli([
            "fit", "--config", str(ROOT / "examples" / "configs" / "finetune_llava.yaml"), *chosen,
            "--trainer.max_steps", str(STEPS), "--trainer.limit_val_batches", "0", "--trainer.callbacks", "[]",
            "--trainer.logger.init_args.save_dir", str(out / "logs"), "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false", "--model.init_args.checkpoint", str(checkpoint),
            "--model.init_args.export_dir", "null", "--data.init_args.path", str(data),
        ])  # fmt: skip
    module, trainer = cli.model, cli.trainer
    result = {
        "losses": module.step_losses,
        "rand_after_load": module.rand_after_load,
        "trained": parts(module.model, True),
        "frozen": parts(module.model, False),
        "pixel_values": list(module.first_batch["pixel_values"].shape),
    }
    engine = getattr(trainer.strategy, "engine", None)
    if engine is not None:
        result["units"] = {rt.name: rt.group.trainable for rt in engine.runtimes}
    return result


def main() -> None:
    out = Path(sys.argv[1])
    checkpoint = make_llava_next(str(out / "pretrained"), TEXT)  # rank 1 starts once rank 0 has written these
    data = out / "data" / "rows.jsonl"
    if not data.exists():
        write_sample_images(data)
    results = {strategy: run(strategy, out, checkpoint, data) for strategy in ("zero3", "ddp")}
    (out / f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
