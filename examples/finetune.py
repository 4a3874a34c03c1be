"""Fine-tuning a pretrained Hugging Face model under zero3: the LightningModule of the fine-tuning jobs
(``examples/configs/finetune_full.yaml``, ``finetune_lora.yaml``).

``configure_model`` builds and loads the model with ``lightning_zero3.from_pretrained``: under zero3 on the
meta device, each rank reading only the bytes of its own shards and drawing no random number for them;
under another strategy it is transformers' ``from_pretrained``.
With ``lora`` set, peft's LoRA adapters wrap the model (the base frozen, the adapters trained). When
``fit`` ends the model is exported as a Hugging Face directory (``export_dir/model``: the adapters
merged into the base weights for LoRA), and a LoRA run also saves peft's adapter files with peft's own
``save_pretrained`` (``export_dir/adapter``). The same module runs under DDP unchanged.

``make_pretrained`` writes a small Llama-style checkpoint with ``save_pretrained`` (bf16, safetensors) and
a subword tokenizer trained locally, so the jobs need no download: with no ``checkpoint`` given,
``prepare_data`` writes it once at ``SAMPLE_CHECKPOINT``. A ``checkpoint`` that is given is read as it is
and never written to.

[Note: the loss over the global token count]
A jsonl batch's loss is the mean over the response tokens of *every* rank's batch, not the mean of each
rank's own mean: rows differ in length, so per-rank means would weigh a token on a rank with few trained
tokens more than one on a rank with many (and a different world size would train a different objective).
Each rank sums its tokens' losses, divides by the count all-reduced over the ranks (one small collective
per step), and multiplies by the world size, because DDP and zero3 average the ranks' gradients: the
gradient is then that of the global mean, and the mean of the logged per-rank values is the global loss.
"""

from __future__ import annotations

import math
import os
import shutil
import uuid
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

import lightning_zero3

#: where the small checkpoint is written when no ``checkpoint`` is given (relative to the working directory)
SAMPLE_CHECKPOINT = "runs/pretrained/tiny-llama"
#: the small LLaVA-Next of the multimodal job (``finetune_llava.yaml``), written when no ``checkpoint`` is given
SAMPLE_IMAGE_CHECKPOINT = "runs/pretrained/tiny-llava-next"
IGNORE = -100  # labels of positions not trained (``sft_data.py``)


@dataclass
class TinyLlama:
    """The shape of the checkpoint ``make_pretrained`` writes (a ``LlamaConfig``'s fields)."""

    vocab_size: int = 256
    hidden_size: int = 128
    intermediate_size: int = 344
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 256
    tie_word_embeddings: bool = False


@dataclass
class LoraSettings:
    """peft's ``LoraConfig`` for the adapters."""

    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    #: start the adapters from a peft adapter directory (``save_pretrained``'s) instead of new ones:
    #: resumes a LoRA fine-tune, and makes runs under different strategies start alike
    adapter: Optional[str] = None


def make_pretrained(directory: str, shape: TinyLlama, seed: int = 0) -> Path:
    """A randomly initialised Llama of ``shape`` saved with ``save_pretrained`` (bf16) at ``directory``;
    kept if it is there already (and refused if that one has another shape). Written to a temporary name first, so a directory there is complete."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(directory)
    if _kept(out, shape, "make_pretrained"):
        return out
    torch.manual_seed(seed)
    with _written_whole(out) as staging:
        tokenizer = _train_tokenizer(staging)  # a real subword tokenizer, trained here (no download)
        config = LlamaConfig(**_llama_settings(shape, tokenizer))
        model = LlamaForCausalLM(config).to(torch.bfloat16)
        model.save_pretrained(staging)
    return out


@contextmanager
def _written_whole(out: Path):
    """A staging directory beside ``out``, moved to ``out`` when the block ends without an error (removed
    otherwise): a directory at ``out`` is always complete."""
    staging = out.with_name(f".{out.name}.partial-{uuid.uuid4().hex[:8]}")
    try:
        yield staging
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _train_tokenizer(directory: Path):
    try:
        from examples.finetune_assets import train_tokenizer
    except ImportError:  # run with examples/ itself on the path
        from finetune_assets import train_tokenizer
    return train_tokenizer(directory)


def _llama_settings(shape: TinyLlama, tokenizer) -> dict:
    """A ``LlamaConfig``'s arguments: ``shape``, and the vocabulary and special tokens of ``tokenizer``."""
    return {**asdict(shape), "vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}  # fmt: skip


def _kept(out: Path, shape: TinyLlama, caller: str, section: Optional[str] = None) -> bool:
    """Whether ``out`` holds a checkpoint already (of ``shape``: one of another shape is refused)."""
    if not (out / "config.json").is_file():
        return False
    import json

    held = json.loads((out / "config.json").read_text())
    held = held.get(section, {}) if section else held
    differ = {k: (held.get(k), v) for k, v in asdict(shape).items() if k != "vocab_size" and held.get(k) != v}
    if differ:
        raise ValueError(
            f"{caller}: {out} holds a checkpoint of another shape ({', '.join(f'{k}: {a} there, {b} asked' for k, (a, b) in differ.items())}); "
            "remove it to write the new one, or write it elsewhere."
        )  # fmt: skip
    return True


def make_llava_next(directory: str, text: TinyLlama, seed: int = 0) -> Path:
    """A randomly initialised LLaVA-Next saved with ``save_pretrained`` (bf16) at ``directory``, with its
    processor: a tiny CLIP vision tower (32-pixel tiles of 8-pixel patches, the any-resolution grid 32x32 and
    32x64), the projector, and a Llama of ``text``'s shape whose tokenizer is ``finetune_assets``'s, trained
    locally, plus the ``<image>`` token. Kept if it is there already, as ``make_pretrained`` does."""
    import transformers as T

    out = Path(directory)
    if _kept(out, text, "make_llava_next", section="text_config"):
        return out
    torch.manual_seed(seed)
    with _written_whole(out) as staging:
        tokenizer = _train_tokenizer(staging)
        tokenizer.add_tokens(["<image>"], special_tokens=True)
        grid = [[32, 32], [32, 64]]
        # transformers 5 names the PIL backend apart (its default one needs torchvision); 4.x's is PIL's
        pil = getattr(T, "LlavaNextImageProcessorPil", None) or T.LlavaNextImageProcessor
        images = pil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}, image_grid_pinpoints=grid)
        # the processor writes as many <image> tokens as the model makes features: CLIP's class token is
        # dropped by the "default" feature selection, hence the one additional token
        processor = T.LlavaNextProcessor(image_processor=images, tokenizer=tokenizer, patch_size=8,
                                         vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                         chat_template=tokenizer.chat_template)  # fmt: skip
        vision = T.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    image_size=32, patch_size=8, projection_dim=32)  # fmt: skip
        language = T.LlamaConfig(**_llama_settings(text, tokenizer))
        config = T.LlavaNextConfig(vision_config=vision, text_config=language, image_grid_pinpoints=grid,
                                   image_token_index=tokenizer.convert_tokens_to_ids("<image>"))  # fmt: skip
        T.LlavaNextForConditionalGeneration(config).to(torch.bfloat16).save_pretrained(staging)
        processor.save_pretrained(staging)
    return out


class CausalLMFineTune(pl.LightningModule):
    """A Hugging Face causal language model, fine-tuned in full or with LoRA adapters.

    Args:
        checkpoint: The pretrained model: a Hugging Face directory (``save_pretrained``'s), used as it is. None:
            a small Llama of ``make_checkpoint``'s shape, written once at ``SAMPLE_CHECKPOINT`` (no download).
        lora: LoRA adapters to train (None: fine-tune every weight).
        lr: AdamW's learning rate.
        weight_decay: AdamW's weight decay.
        export_dir: Where the fine-tuned model is written when ``fit`` ends (None: not exported).
        make_checkpoint: The shape of that small random Llama (with a subword tokenizer trained locally:
            ``finetune_assets.py``); only used when no ``checkpoint`` is given.
        warmup_steps: Steps of linear warmup before the cosine decay (with ``max_steps`` set; 0: constant lr).
        activation_checkpointing: Recompute each block's activations in the backward pass
            (``gradient_checkpointing_enable``, non-reentrant): less memory, about a third more compute.
    """

    def __init__(
        self,
        checkpoint: Optional[str] = None,
        lora: Optional[LoraSettings] = None,
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        export_dir: Optional[str] = None,
        make_checkpoint: Optional[TinyLlama] = None,
        warmup_steps: int = 0,
        activation_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        self.checkpoint = checkpoint if checkpoint is not None else SAMPLE_CHECKPOINT
        self.lora, self.export_dir = lora, export_dir
        self.lr, self.weight_decay = lr, weight_decay
        self.make_checkpoint = (make_checkpoint or TinyLlama()) if checkpoint is None else None
        self.warmup_steps, self.activation_checkpointing = warmup_steps, activation_checkpointing
        self.model = None
        self.step_losses: list[float] = []  # this rank's loss of every training step
        self.first_batch = None  # the first training batch this rank saw (for comparisons)

    def prepare_data(self) -> None:
        if self.make_checkpoint is not None:
            make_pretrained(self.checkpoint, self.make_checkpoint)
        elif not (Path(self.checkpoint) / "config.json").is_file():
            raise FileNotFoundError(
                f"CausalLMFineTune: {self.checkpoint} is not a Hugging Face checkpoint (no config.json there); "
                "give the directory `save_pretrained` wrote, or leave `checkpoint` out to fine-tune the small "
                "sample model written locally."
            )

    def pretrained(self, auto_class) -> torch.nn.Module:
        """``auto_class``'s model for the checkpoint, its weights read in, activation checkpointing as set.
        Under zero3 it is built on the meta device and the weights are read straight into the shards, with
        no random number drawn for them; under another strategy it is ``from_pretrained``. fp32 masters
        whatever the checkpoint's dtype (the `precision` flag decides what computes)."""
        model = lightning_zero3.from_pretrained(auto_class, self.checkpoint, dtype=torch.float32)
        if self.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from transformers import AutoModelForCausalLM

        model = self.pretrained(AutoModelForCausalLM)
        if self.lora is not None:
            from peft import LoraConfig, get_peft_model

            settings = LoraConfig(r=self.lora.r, lora_alpha=self.lora.alpha, lora_dropout=self.lora.dropout,
                                  target_modules=list(self.lora.target_modules))  # fmt: skip
            model = get_peft_model(model, settings)
            if self.lora.adapter is not None:
                lightning_zero3.load_pretrained(model, self.lora.adapter)  # the LoRA tensors only
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids).logits

    def loss(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(ids)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def batch_loss(self, batch) -> torch.Tensor:
        """A jsonl batch (``input_ids``, ``attention_mask`` or packed rows' ``position_ids``, ``labels`` with
        -100 where not trained: ``sft_data.py``), its loss over the trained tokens of all ranks (see [Note: the loss over the global
        token count]); or (ids, targets) windows of plain tokens."""
        if not isinstance(batch, dict):
            return self.loss(*batch[:2])
        trained = (batch["labels"][:, 1:] != IGNORE).sum()  # the model predicts position t+1 from t
        world = self.trainer.world_size
        if world > 1:
            trained = self.trainer.strategy.reduce(trained, reduce_op="sum")
        # transformers' causal-LM loss sums over the tokens and divides by ``num_items_in_batch``; no KV cache:
        # training reads none, and with one transformers ignores packed rows' position ids ([Note: packed rows])
        return self.model(**batch, num_items_in_batch=trained.clamp(min=1), use_cache=False).loss * world

    def training_step(self, batch, batch_idx):
        loss = self.batch_loss(batch)
        if loss.is_meta:  # the estimate's measuring forward on a meta batch (lightning-zero3 estimate): no values
            return loss
        if self.first_batch is None:
            self.first_batch = {k: v.detach().cpu() for k, v in batch.items()} if isinstance(batch, dict) else \
                tuple(t.detach().cpu() for t in batch[:2])  # fmt: skip
        self.step_losses.append(loss.item())
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.batch_loss(batch), sync_dist=True)

    def configure_optimizers(self):
        trainable = [p for p in self.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=self.lr, weight_decay=self.weight_decay)
        if self.warmup_steps <= 0:
            return optimizer
        total = max(self.trainer.max_steps, self.warmup_steps + 1)
        warmup, total_steps = self.warmup_steps, total

        def factor(step: int) -> float:  # linear warmup, then cosine down to 10% of lr
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
            return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def on_fit_end(self) -> None:
        if self.export_dir is None:
            return
        out = Path(self.export_dir)
        if self.lora is not None and self.trainer.is_global_zero:
            self.model.save_pretrained(out / "adapter")  # peft's own call: the adapters are whole on every rank
        # every rank takes part (the units are gathered one at a time); rank 0 writes
        lightning_zero3.save_full_weights(self.model, out / "model", fmt="hf")


class ImageTextFineTune(CausalLMFineTune):
    """A Hugging Face image-text-to-text model (LLaVA-Next, LLaVA, ...) fine-tuned on image conversations
    (``sft_images.ImageConversations``): the modules named in ``freeze`` (the vision tower) stay as loaded,
    the rest (the projector, the language model) trains. Loading, loss and export are ``CausalLMFineTune``'s.

    Args:
        checkpoint: The pretrained model's directory (``save_pretrained``'s, with its processor). None: a small
            LLaVA-Next whose language model has ``make_checkpoint``'s shape, written once at
            ``SAMPLE_IMAGE_CHECKPOINT`` (``make_llava_next``; no download).
        freeze: Submodules kept frozen (no gradient, no optimizer state; their zero3 units hold no gradient shard).
        Others: as ``CausalLMFineTune``.
    """

    def __init__(
        self,
        checkpoint: Optional[str] = None,
        freeze: tuple[str, ...] = ("model.vision_tower",),
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        export_dir: Optional[str] = None,
        make_checkpoint: Optional[TinyLlama] = None,
        warmup_steps: int = 0,
        activation_checkpointing: bool = False,
    ) -> None:
        super().__init__(checkpoint, None, lr, weight_decay, export_dir, make_checkpoint, warmup_steps,
                         activation_checkpointing)  # fmt: skip
        self.checkpoint = checkpoint if checkpoint is not None else SAMPLE_IMAGE_CHECKPOINT
        self.freeze = tuple(freeze)

    def prepare_data(self) -> None:
        if self.make_checkpoint is not None:
            make_llava_next(self.checkpoint, self.make_checkpoint)
        else:
            super().prepare_data()

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from transformers import AutoModelForImageTextToText

        model = self.pretrained(AutoModelForImageTextToText)
        for name in self.freeze:
            model.get_submodule(name).requires_grad_(False)
        self.model = model
