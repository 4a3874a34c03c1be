"""LoRA adapters merged into their base weights on export: the Hugging Face directory that, under DDP,
``peft_model.merge_and_unload().save_pretrained(dir)`` writes, streamed unit by unit (``full_weights.py``).

For each peft LoRA ``Linear`` the exported ``weight`` is the base layer's weight plus, for each active
adapter, ``B @ A * scaling`` (transposed for ``fan_in_fan_out`` layers), computed as peft computes it,
from the masters (so in the master dtype, as peft merges under DDP). The adapters' own tensors are not
written and the base layers' names lose their ``base_layer.`` part, so ``from_pretrained`` of the
directory gives the merged model. The adapters (whole on every rank in the usual case, rule 4 of
``engine/layout/units.py``) are read first; then each base weight is merged while its unit is gathered.

Layers peft merges in other ways (DoRA and other variants, LoRA on embeddings or convolutions, adapter
biases) are refused with an error naming the layer, not exported unmerged.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

if TYPE_CHECKING:
    from ..engine import Zero3Engine


@dataclass
class Delta:
    """One adapter of one layer: ``delta = transpose(B @ A, fan_in_fan_out) * scaling``."""

    a: nn.Parameter
    b: nn.Parameter
    scaling: float
    fan_in_fan_out: bool


@dataclass
class LoraMerge:
    """What merging changes in an export: names renamed, names dropped, deltas by id of the base weight."""

    renames: dict[str, str] = field(default_factory=dict)
    dropped: set[str] = field(default_factory=set)
    deltas: dict[int, list[Delta]] = field(default_factory=dict)

    def exported_name(self, name: str) -> Optional[str]:
        return None if name in self.dropped else self.renames.get(name, name)

    @property
    def adapter_params(self) -> list[nn.Parameter]:
        return [p for deltas in self.deltas.values() for d in deltas for p in (d.a, d.b)]


def lora_merge(module: nn.Module) -> Optional[LoraMerge]:
    """The merge of every peft LoRA layer inside ``module`` (None when it has none)."""
    if "peft" not in sys.modules:
        return None
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    layers = [(path, m) for path, m in module.named_modules() if isinstance(m, LoraLayer)]
    if not layers:
        return None
    merge = LoraMerge()
    names = list(module.state_dict(keep_vars=True))
    for path, layer in layers:
        adapters = [a for a in layer.active_adapters if a in layer.lora_A]
        unsupported = (
            not isinstance(layer, LoraLinear) or layer.merged
            or any(a in layer.lora_variant or layer.lora_bias.get(a) for a in adapters)
        )  # fmt: skip
        if unsupported:
            raise ValueError(
                f"zero3: cannot merge the adapter of {path} ({type(layer).__name__}) on export: only plain LoRA on "
                "Linear layers, unmerged, without DoRA or adapter biases, is merged here. Save the adapter with "
                "`save_pretrained` instead, or merge after `lightning_zero3.unshard(model)`."
            )
        weight = layer.get_base_layer().weight
        merge.deltas[id(weight)] = [
            Delta(layer.lora_A[a].weight, layer.lora_B[a].weight, layer.scaling[a], layer.fan_in_fan_out) for a in adapters
        ]  # fmt: skip
        head = f"{path}." if path else ""
        for name in names:
            if name.startswith(f"{head}base_layer."):
                merge.renames[name] = head + name[len(f"{head}base_layer.") :]
            elif name.startswith(f"{head}lora_"):
                merge.dropped.add(name)
    return merge


def adapter_values(merge: LoraMerge, engine: Optional["Zero3Engine"]) -> dict[int, torch.Tensor]:
    """Every adapter tensor's full value in the master dtype, by id of its parameter (a collective under
    zero3: the groups holding them are gathered one after the other, the same on every rank)."""
    wanted = {id(p): p for p in merge.adapter_params}
    if engine is None:
        return {key: p.detach() for key, p in wanted.items()}
    values: dict[int, torch.Tensor] = {}
    for runtime in engine.runtimes:
        group = runtime.group
        slots = [slot for slot in group.slots if id(slot.param) in wanted]
        if slots:
            with group.gathered_master() as master:
                for slot in slots:
                    values[id(slot.param)] = master[slot.offset : slot.offset + slot.numel].view(slot.param.shape).clone()
    return values


def merged(weight: torch.Tensor, deltas: list[Delta], values: dict[int, torch.Tensor]) -> torch.Tensor:
    """``weight`` with its adapters added, as peft's ``merge`` adds them (a new tensor)."""
    out = weight.clone()
    for delta in deltas:
        product = values[id(delta.b)] @ values[id(delta.a)]
        out += (product.T if delta.fan_in_fan_out else product) * delta.scaling
    return out
