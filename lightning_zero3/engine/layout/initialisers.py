"""How the libraries a model comes from initialise its modules, for modules built on the meta device.

A module's ``reset_parameters()`` is torch's convention, and all that an ``nn.Linear`` knows. Models
from libraries initialise more than that, after construction, in code the meta device skips:
- Hugging Face models run ``PreTrainedModel._init_weights(module)`` for every module (``post_init``):
  normal(0, ``initializer_range``) weights, and the rotary embeddings' ``inv_freq`` buffers, which
  are computed, not learned, and not in any checkpoint (left at zeros, every position would look alike);
- peft's LoRA layers zero ``lora_B`` (so the adapted model starts as the base model) and draw
  ``lora_A``: ``LoraLayer.reset_lora_parameters(adapter, init_lora_weights)``, applied here half by half.
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

import math
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
    halves: dict[int, tuple[str, LoraLayer, str]] = {}  # id(module holding a half) -> (half, layer, adapter)
    for layer in (m for m in root.modules() if isinstance(m, LoraLayer)):
        for half, table in (("A", layer.lora_A), ("B", layer.lora_B)):
            halves.update({id(module): (half, layer, name) for name, module in table.items()})
        for half, table in (("embedding A", layer.lora_embedding_A), ("embedding B", layer.lora_embedding_B)):
            halves.update({id(table): (half, layer, name) for name in table.keys()})
    if not halves:
        return []
    for layer in {id(layer): layer for _, layer, _ in halves.values()}.values():
        for name in layer.r:
            tables = [table[name] for table in (layer.lora_A, layer.lora_B) if name in table]
            unbuilt = any(p.is_meta for half in tables for p in half.parameters())
            if unbuilt and settings.get(name, True) not in (True, False, "gaussian"):
                raise ValueError(  # on every rank, before any unit is built
                    f"zero3: LoRA init_lora_weights={settings[name]!r} (adapter {name!r}) computes the adapters from "
                    "the base weights, which a model built on the meta device does not have while it is being "
                    "sharded. Initialise the adapters once without zero3 and save them "
                    "(`PeftModel.save_pretrained(dir)`), then build with init_lora_weights=True and read them in with `lightning_zero3.load_pretrained(model, dir)`."
                )

    def initialise(modules: list[nn.Module]) -> None:
        for module in modules:
            if id(module) in halves:
                half, layer, name = halves[id(module)]
                _init_lora_half(module, half, layer, name, settings.get(name, True))

    return [initialise]


def _init_lora_half(module: nn.Module, half: str, layer: nn.Module, adapter: str, rule) -> None:
    """peft's ``reset_lora_parameters`` for one half of an adapter, alone.

    The two halves of an adapter may fall in different units, so one may be built (and released to its
    shards) before the other: each half gets peft's rule for it when it is built, never touching the other.
    (The rules that read the base weights, PiSSA, OLoRA, LoftQ and the like, were refused by ``_lora``.)"""
    if rule is False:  # peft keeps the layers' own init: the ``reset_parameters()`` that ran before this
        return
    if half == "A":
        if rule is True:  # as nn.Linear's own default
            nn.init.kaiming_uniform_(module.weight, a=math.sqrt(5))
        else:
            nn.init.normal_(module.weight, std=1 / layer.r[adapter])
    elif half == "B":  # zero: the adapted model starts as the base model
        for p in module.parameters(recurse=False):
            nn.init.zeros_(p)
    elif half == "embedding A":
        nn.init.zeros_(module[adapter])
    else:
        nn.init.normal_(module[adapter])
