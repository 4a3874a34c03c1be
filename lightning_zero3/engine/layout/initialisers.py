"""How the libraries a model comes from initialise its modules, for modules built on the meta device.

A module's ``reset_parameters()`` is torch's convention, and all that an ``nn.Linear`` knows. Models
from libraries initialise more than that, after construction, in code the meta device skips:
- Hugging Face models run ``PreTrainedModel._init_weights(module)`` for every module (``post_init``):
  normal(0, ``initializer_range``) weights, and the rotary embeddings' ``inv_freq`` buffers, which
  are computed, not learned, and not in any checkpoint (left at zeros, every position would look alike);
- peft's LoRA layers zero ``lora_B`` (so the adapted model starts as the base model) and draw
  ``lora_A``: ``LoraLayer.reset_lora_parameters(adapter, init_lora_weights)``.
Each initialiser here takes the modules being initialised at once (see ``materialize.py``) and applies
its library's own rule to those that belong to it. Libraries are looked for only when the program has
imported them.

These run only for modules whose construction was not recorded (see [Note: eager construction replayed]
in materialize.py). A Hugging Face model built under zero3's contexts runs ``post_init`` in its own
``__init__`` (transformers skips it only when the default device is meta, which zero3's contexts never
set): its ``_init_weights`` draws, in ``model.apply`` order (post-order), are recorded and replayed
exactly. Here, on a plain meta build, ``_init_weights`` runs unit by unit in build order, from a stream
of its own: other numbers than an eager build's, which no order of calls could restore (eager's draws
begin after every constructor's ``reset_parameters()`` drew, which a meta build never did).
"""

from __future__ import annotations

import sys
from typing import Callable

from torch import nn

Initialiser = Callable[[list[nn.Module]], None]


def library_initialisers(root: nn.Module) -> list[Initialiser]:
    """The initialisers of the libraries whose models sit inside ``root``, in the order they run."""
    found = []
    if "transformers" in sys.modules:
        found.extend(_hugging_face(root))
    if "peft" in sys.modules:
        found.extend(_lora(root))
    return found


def _hugging_face(root: nn.Module) -> list[Initialiser]:
    from transformers import PreTrainedModel

    owner: dict[int, PreTrainedModel] = {}  # id(module) -> the innermost Hugging Face model holding it
    for model in (m for m in root.modules() if isinstance(m, PreTrainedModel)):
        for module in model.modules():
            owner[id(module)] = model
    if not owner:
        return []

    def initialise(modules: list[nn.Module]) -> None:
        for module in modules:
            model = owner.get(id(module))
            if model is not None:
                model._init_weights(module)

    return [initialise]


def _lora(root: nn.Module) -> list[Initialiser]:
    from peft.tuners.lora import LoraLayer, LoraModel

    settings = {}  # adapter name -> its init_lora_weights, from the LoRA model's own configs
    for model in (m for m in root.modules() if isinstance(m, LoraModel)):
        settings.update({name: config.init_lora_weights for name, config in model.peft_config.items()})
    adapters: dict[int, tuple[LoraLayer, str]] = {}  # id(lora_A / lora_B module) -> (layer, adapter)
    for layer in (m for m in root.modules() if isinstance(m, LoraLayer)):
        for table in (layer.lora_A, layer.lora_B):
            for name, module in table.items():
                adapters[id(module)] = (layer, name)
    if not adapters:
        return []

    def initialise(modules: list[nn.Module]) -> None:
        touched = {adapters[id(m)] for m in modules if id(m) in adapters}
        for layer, name in touched:
            pair = [layer.lora_A[name], layer.lora_B[name]]
            if not any(p.is_meta for m in pair for p in m.parameters()):  # both halves built
                layer.reset_lora_parameters(name, settings.get(name, True))

    return [initialise]
