"""litgpt's own pretraining and fine-tuning code, run with zero3: litgpt's ``main`` functions on a Fabric
with ``strategy="zero3"``.

    python examples/litgpt_zero3.py pretrain --out runs/litgpt-pretrain            # 2 CPU ranks, 20 steps
    python examples/litgpt_zero3.py finetune_full --out runs/litgpt-full
    python examples/litgpt_zero3.py finetune_lora --out runs/litgpt-lora
    python examples/litgpt_zero3.py pretrain --strategy fsdp ...                   # litgpt's own choice (GPUs)
    python examples/litgpt_zero3.py pretrain --strategy fsdp2 ...                  # FSDP2 per Block (CPU too)

litgpt's ``setup`` functions build their ``Fabric`` themselves, with ``FSDPStrategy`` whenever there is
more than one device; everything after that is litgpt's ``main``: the model built under
``fabric.init_module(empty_init=True)`` (litgpt's init through ``reset_parameters``, which zero3 calls
as it builds each unit), ``torch.compile`` (pretraining), ``fabric.setup``, the loop with
``no_backward_sync``, ``clip_gradients`` and ``fabric.save``. So this script does what ``setup`` does
(a config, data, a logger) with a Fabric of its own, and calls litgpt's ``main`` as it is.

Two patches, here and nowhere else, set on litgpt's job modules while a job runs:
- litgpt's ``load_checkpoint`` sends a checkpoint to ``fabric.load_raw`` only under ``FSDPStrategy`` and
  otherwise calls ``model.load_state_dict``, which a sharded model refuses (its parameters are
  released); under zero3 it reads the file straight into the shards (``load_pretrained``), with the
  renames litgpt's LoRA modules make in ``_load_from_state_dict`` (which only ``load_state_dict`` runs);
- litgpt's ``save_hyperparameters`` parses ``sys.argv`` as litgpt's own command line (this script's is
  another), so the job's settings are written to the same ``hyperparameters.yaml`` from here.

No download: the model is a tiny litgpt ``Config`` with random weights, the data random token windows
(``RandomTokens``), and every job starts from a ``lit_model.pth`` this script writes first (with a
byte-level ``tokenizer.json`` beside it, which fine-tuning reads): pretraining loads it as litgpt's
``initial_checkpoint_dir``, so every strategy starts from the same weights. Every rank records the losses litgpt logs in ``OUT/losses-<rank>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers import Logger
from torch.utils.data import DataLoader

import lightning_zero3

CONFIG = dict(name="tiny-zero3", block_size=32, vocab_size=256, padded_vocab_size=256, n_layer=2, n_head=2,
              n_embd=64, rotary_percentage=1.0, parallel_residual=False, bias=False, norm_class_name="RMSNorm",
              mlp_class_name="LLaMAMLP", intermediate_size=128)  # fmt: skip

LORA = dict(lora_r=4, lora_alpha=8, lora_query=True, lora_value=True)


class LossLog(Logger):
    """A Fabric logger that keeps the metrics litgpt logs (``loss`` every ``log_interval`` iterations)."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    @property
    def name(self) -> str:
        return "losses"

    @property
    def version(self) -> str:
        return "0"

    def log_metrics(self, metrics: dict[str, Any], step: Optional[int] = None) -> None:
        self.rows.append({k: float(v) for k, v in metrics.items() if isinstance(v, (int, float, torch.Tensor))})

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


@dataclass
class RandomTokens:
    """A litgpt ``DataModule`` of deterministic random token windows: ``(B, T + 1)`` tensors for
    pretraining, ``{"input_ids", "labels", "token_counts"}`` batches for fine-tuning (what litgpt's SFT
    data gives)."""

    sft: bool = False
    samples: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        from litgpt.prompts import Default

        self.prompt_style = Default()
        self.batch_size, self.max_seq_length = 1, CONFIG["block_size"]

    def connect(self, tokenizer: Any = None, batch_size: int = 1, max_seq_length: Optional[int] = None) -> None:
        self.batch_size = batch_size
        if max_seq_length is not None and max_seq_length > 0:
            self.max_seq_length = max_seq_length

    def prepare_data(self) -> None:
        pass

    def setup(self, stage: str = "") -> None:
        g = torch.Generator().manual_seed(self.seed)
        start = torch.randint(0, CONFIG["vocab_size"], (self.samples, 1), generator=g)
        stride = torch.randint(1, 4, (self.samples, 1), generator=g)
        self.tokens = (start + stride * torch.arange(self.max_seq_length + 1)) % CONFIG["vocab_size"]

    def _loader(self, tokens: torch.Tensor) -> DataLoader:
        if not self.sft:
            return DataLoader(tokens, batch_size=self.batch_size, shuffle=False)
        length = torch.tensor(self.max_seq_length)  # litgpt's SFT batches count their tokens too
        batches = [{"input_ids": t[:-1], "labels": t[1:], "token_counts": {"raw": length, "raw_plus_prompt_template": length}}
                   for t in tokens]  # fmt: skip
        return DataLoader(batches, batch_size=self.batch_size, shuffle=False)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.tokens[16:])

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.tokens[:16])


def write_checkpoint(directory: Path) -> Path:
    """A randomly initialised ``lit_model.pth`` of ``CONFIG`` with its ``model_config.yaml`` and a
    byte-level ``tokenizer.json`` (litgpt's fine-tuning reads all three)."""
    from litgpt import GPT, Config
    from litgpt.utils import save_config
    from tokenizers import Tokenizer, models

    directory.mkdir(parents=True, exist_ok=True)
    if not (directory / "lit_model.pth").is_file():
        torch.manual_seed(0)
        config = Config(**CONFIG)
        torch.save(GPT(config).state_dict(), directory / "lit_model.pth")
        save_config(config, directory)
        vocab = {chr(i) if chr(i).isprintable() else f"<{i}>": i for i in range(CONFIG["vocab_size"])}
        Tokenizer(models.WordLevel(vocab, unk_token="<0>")).save(str(directory / "tokenizer.json"))
        (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return directory


def zero3_fabric(strategy: str, devices: int, logger: Logger) -> Fabric:
    chosen: Any = strategy
    if strategy == "zero3":  # full checkpoints, as litgpt's FSDP runs save them (state_dict_type="full")
        chosen = lightning_zero3.Zero3FabricStrategy(checkpoint_format="full", persistence_threshold=1000)
    elif strategy == "fsdp":  # what litgpt's setup builds for several devices (Fabric allows it on GPUs only)
        from lightning.fabric.strategies import FSDPStrategy
        from litgpt.model import Block

        chosen = FSDPStrategy(auto_wrap_policy={Block}, state_dict_type="full")
    elif strategy == "fsdp2":  # torch FSDP2, one unit per litgpt Block, through Fabric's ModelParallelStrategy
        from lightning.fabric.strategies import ModelParallelStrategy

        chosen = ModelParallelStrategy(parallelize_fn=_fully_shard_blocks, data_parallel_size=devices,
                                       tensor_parallel_size=1, save_distributed_checkpoint=False)
    fabric = Fabric(devices=devices, strategy=chosen, accelerator="cpu", precision="32-true", loggers=[logger])
    fabric.launch()
    return fabric


def _fully_shard_blocks(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    from litgpt.model import Block
    from torch.distributed.fsdp import fully_shard

    for block in [m for m in model.modules() if isinstance(m, Block)]:
        fully_shard(block, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def _load_checkpoint_patched(fabric: Fabric, model: torch.nn.Module, checkpoint_path: Path, strict: bool = True) -> None:
    """litgpt's ``load_checkpoint``, with zero3 taking litgpt's FSDP branch (see the module's docstring).

    litgpt's LoRA modules rename a base checkpoint's ``qkv.weight`` to their ``qkv.linear.weight`` in
    ``_load_from_state_dict``, which only ``model.load_state_dict`` runs; reading into shards (zero3's
    ``load_pretrained``, FSDP2's ``set_model_state_dict``) needs the names given: ``_litgpt_names``."""
    original = getattr(model, "module", model)  # inside Fabric's wrapper
    rename = _litgpt_names(original)
    if isinstance(fabric.strategy, lightning_zero3.Zero3FabricStrategy):
        lightning_zero3.load_pretrained(original, checkpoint_path, strict=strict, key_map=rename)
        return
    state = torch.load(checkpoint_path, mmap=True, weights_only=True)
    renamed = checkpoint_path.with_name(f"renamed-{fabric.global_rank}-{checkpoint_path.name}")
    torch.save({rename(k): v for k, v in state.get("model", state).items()}, renamed)
    try:
        fabric.load_raw(renamed, model, strict=strict)
    finally:
        renamed.unlink()


def _litgpt_names(model: torch.nn.Module):
    """A base checkpoint's name -> the LoRA model's (``P.weight`` -> ``P.linear.weight`` where only that is the model's)."""
    names = set(model.state_dict(keep_vars=True))

    def rename(name: str) -> str:
        head, _, leaf = name.rpartition(".")
        wrapped = f"{head}.linear.{leaf}"
        return wrapped if name not in names and wrapped in names else name

    return rename


def _settings_writer(settings: dict):
    """litgpt's ``save_hyperparameters(function, directory)``, writing this job's settings instead."""

    def save_hyperparameters(function: Any, checkpoint_dir: Path) -> None:
        import yaml

        (Path(checkpoint_dir) / "hyperparameters.yaml").write_text(yaml.safe_dump(settings))

    return save_hyperparameters


def run(job: str, strategy: str, out: Path, devices: int, steps: int) -> list[dict]:
    from litgpt import Config
    from litgpt.args import EvalArgs, TrainArgs

    logger = LossLog()
    fabric = zero3_fabric(strategy, devices, logger)
    config = Config(**CONFIG)
    evaluate = EvalArgs(interval=10_000, max_iters=2, initial_validation=False, final_validation=False)
    # every job starts from the same written weights (pretraining as litgpt's `--initial_checkpoint_dir`)
    checkpoint = write_checkpoint(out / "checkpoint") if fabric.global_rank == 0 else out / "checkpoint"
    fabric.barrier()
    # what litgpt's hyperparameters.yaml holds of a job (LoRA's merge after training reads it back)
    settings = {"job": job, "strategy": strategy, "devices": devices, "steps": steps, "checkpoint_dir": str(checkpoint),
                "precision": "32-true", **LORA}  # fmt: skip
    if job == "pretrain":
        import litgpt.pretrain as pretrain

        pretrain.save_hyperparameters = _settings_writer(settings)

        train = TrainArgs(save_interval=None, log_interval=1, global_batch_size=4 * devices, micro_batch_size=2,
                          max_tokens=steps * 4 * devices * CONFIG["block_size"], max_norm=1.0, min_lr=1e-4,
                          lr_warmup_steps=2, tie_embeddings=False)  # fmt: skip
        pretrain.main(fabric=fabric, devices=devices, seed=42, initial_checkpoint_dir=checkpoint, resume=False,
                      config=config, data=RandomTokens(), out_dir=out, tokenizer_dir=None, tokenizer=None,
                      train=train, eval=evaluate, optimizer={"class_path": "torch.optim.AdamW",
                                                             "init_args": {"lr": 1e-3}})  # fmt: skip
    else:
        import litgpt.finetune.full as full
        import litgpt.finetune.lora as lora

        train = TrainArgs(save_interval=None, log_interval=1, global_batch_size=4 * devices, micro_batch_size=2,
                          epochs=1, max_steps=steps, lr_warmup_steps=1, max_norm=None)  # fmt: skip
        optimizer = {"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-3}}
        module = full if job == "finetune_full" else lora
        # litgpt's FSDP branch for the sharded strategies (FSDP2 refuses `load_state_dict` of full tensors too)
        module.load_checkpoint = _load_checkpoint_patched if strategy in ("zero3", "fsdp2") else module.load_checkpoint
        module.save_hyperparameters = _settings_writer(settings)
        evaluate = EvalArgs(interval=10_000, max_new_tokens=4, max_iters=2, initial_validation=False, final_validation=False)
        common = dict(fabric=fabric, devices=devices, seed=42, data=RandomTokens(sft=True), checkpoint_dir=checkpoint,
                      out_dir=out, train=train, eval=evaluate, optimizer=optimizer)  # fmt: skip
        if job == "finetune_full":
            full.main(resume=False, config=config, **common)
        else:
            from litgpt.lora import Config as LoRAConfig

            lora_config = LoRAConfig(**CONFIG, **LORA)
            lora.main(config=lora_config, **common)
    (out / f"losses-{fabric.global_rank}.json").write_text(json.dumps(logger.rows))
    return logger.rows


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("job", choices=["pretrain", "finetune_full", "finetune_lora"])
    parser.add_argument("--strategy", default="zero3", choices=["zero3", "fsdp", "fsdp2", "ddp"])
    parser.add_argument("--out", type=Path, default=Path("runs/litgpt"))
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    run(args.job, args.strategy, args.out, args.devices, args.steps)


if __name__ == "__main__":
    main(sys.argv[1:])
