"""``from_pretrained(model_class, path)``: a Hugging Face model built and loaded in one call, under any strategy.

Under zero3 (inside ``configure_model``, or ``init_module(empty_init=True)``) the model is built as
transformers' ``from_pretrained`` builds it: every tensor on the meta device, nothing drawn, not even by
an ``__init__`` that draws a parameter's value itself (LLaVA-Next's ``image_newline``); its buffers are
given memory and computed by the model's own initialisation, and ``load_pretrained`` reads each rank's
shards straight from the file (see [Note: draws wait for a load] in engine/layout/materialize.py).
Elsewhere it is ``from_pretrained`` itself, so the same ``configure_model`` runs under DDP.
"""

from __future__ import annotations

import os
from typing import Any, Union

import torch
from torch import nn

from ..engine.layout.materialize import adopt, built_whole_on_meta, recording
from .load import load_pretrained


def from_pretrained(model_class: Any, path: Union[str, "os.PathLike[str]"], **kwargs: Any) -> nn.Module:
    """``model_class.from_pretrained(path, **kwargs)`` (an ``AutoModel...`` class or a model class), whose
    weights, under zero3, each rank reads straight into its shards with no random number drawn for them.
    ``kwargs``: what ``from_config`` takes too (``dtype``, ``attn_implementation``, ...). As
    ``from_pretrained``, tensors the checkpoint lacks get the model's initialisation (and are logged)."""
    # under a plain ``torch.device("meta")`` (the estimate) only the shapes are wanted, and transformers'
    # from_pretrained refuses that context: the model is built from its config, nothing read
    shapes_only = not recording() and torch.empty(()).is_meta
    if not recording() and not shapes_only:
        return model_class.from_pretrained(path, **kwargs)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    build = getattr(model_class, "from_config", None) or model_class._from_config
    if shapes_only:
        return build(config, **kwargs)
    with built_whole_on_meta():
        model = build(config, **kwargs)
    adopt(model)
    _give_buffers_memory(model)
    return load_pretrained(model, path, strict=False)  # as from_pretrained: what is missing is initialised, logged


def _give_buffers_memory(model: nn.Module) -> None:
    """Buffers built on the meta device, on the building device: the checkpoint's are read into them, the
    others (a rotary embedding's ``inv_freq``) the model's own initialisation computes, as in ``from_pretrained``."""
    import torch

    device = torch.get_default_device()
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_meta:
                module._buffers[name] = torch.empty_like(buffer, device=device)
