"""What the fine-tuning jobs are held against under DDP: the model as transformers' ``from_pretrained`` (and
peft's own loaders) give it, instead of the recipe's ``from_config`` + ``load_pretrained``; and the random
generator right after the load, on every rank, for both."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from examples.finetune import CausalLMFineTune


def _from_pretrained(self, auto_class) -> torch.nn.Module:
    model = auto_class.from_pretrained(self.checkpoint, dtype=torch.float32)
    if self.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _with_peft(self, model: torch.nn.Module) -> torch.nn.Module:
    """New adapters by ``get_peft_model``; saved ones by peft's loader, which builds them empty and draws
    nothing (``low_cpu_mem_usage=True``), as zero3 draws nothing for tensors a checkpoint holds."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if self.lora.adapter is not None:
        return PeftModel.from_pretrained(model, self.lora.adapter, is_trainable=True, low_cpu_mem_usage=True)
    lora = self.lora
    settings = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                          target_modules=list(lora.target_modules))  # fmt: skip
    return get_peft_model(model, settings)


def _configure_model(self) -> None:
    if self.model is not None:
        return
    from transformers import AutoModelForCausalLM

    model = _from_pretrained(self, AutoModelForCausalLM)
    self.model = _with_peft(self, model) if self.lora is not None else model


def _note_generator(self) -> None:
    """``torch.rand`` as drawn right after the load (the generator is put back: training is not changed)."""
    state = torch.get_rng_state()
    self.rand_after_load = torch.rand(4).tolist()
    torch.set_rng_state(state)


@contextmanager
def from_pretrained_reference() -> Iterator[None]:
    """Within the block the jobs' modules load as ``from_pretrained`` does (DDP's reference)."""
    saved = CausalLMFineTune.configure_model, CausalLMFineTune.pretrained
    CausalLMFineTune.configure_model, CausalLMFineTune.pretrained = _configure_model, _from_pretrained
    try:
        yield
    finally:
        CausalLMFineTune.configure_model, CausalLMFineTune.pretrained = saved


# every run notes its generator once the model is built and sharded (before any data is drawn)
CausalLMFineTune.on_fit_start = _note_generator
