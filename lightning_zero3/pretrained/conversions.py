"""A Hub checkpoint's names and layout into the model's, by transformers' own rules for that model.

``from_pretrained`` converts many checkpoints as it loads them: LLaVA, LLaVA-Next and Gemma 3 files name
``language_model.model.layers.*`` what the model calls ``model.language_model.layers.*``; Mixtral and
Qwen2-MoE files hold one ``w1`` / ``w2`` / ``w3`` per expert where the model holds fused
``experts.gate_up_proj [E, 2I, H]`` and ``experts.down_proj [E, H, I]``. The rules are transformers'
(no list of families here):

- transformers 5.x: ``conversion_mapping.get_model_conversion_mapping(model)``: every ``WeightRenaming``
  in order, then at most one ``WeightConverter`` per name, whose operations ``MergeModulelist``,
  ``Concatenate`` and ``Chunk`` become range readers (``fused.py``, [Note: reading a fused slice]), so
  each rank still reads only the bytes of its own shards. Any other operation (``Transpose``, RoPE
  permutes, interleaves, quantizers) cannot be read by range: the load fails before any weight changes,
  naming the tensor and the rule.
- transformers 4.5x: the class's ``_checkpoint_conversion_mapping`` (regex -> replacement, renames only;
  4.5x MoE models have no fused experts).

Experts are joined in the order of the index in their names, which must be exactly 0..E-1 (transformers
joins in sorted-list order, so a missing expert would shift the others silently).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from torch import nn

from ..checkpoint.sharded import CheckpointMismatchError
from .fused import Joined, Part

SLICEABLE = ("MergeModulelist", "Concatenate", "Chunk")


def to_model_names(module: nn.Module, tensors: Mapping[str, Any], model_names: Mapping[str, Any]) -> dict[str, Any]:
    """``tensors`` (checkpoint name -> source) renamed and joined into the model's names, as
    ``from_pretrained`` would; unchanged for a model that is not a transformers model."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return dict(tensors)
    if not isinstance(module, PreTrainedModel):
        return dict(tensors)
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:  # transformers 4.5x
        return _class_renames(module, tensors)
    rules = get_model_conversion_mapping(module)
    renamings = [r for r in rules if isinstance(r, WeightRenaming)]
    converters = [r for r in rules if isinstance(r, WeightConverter)]
    base = getattr(module, "base_model_prefix", None) or None
    known = dict.fromkeys(model_names, True)
    out: dict[str, Any] = {}
    groups: dict[tuple[int, str], dict[str, list[tuple[str, str, Any]]]] = {}
    used: dict[int, Any] = {}
    for name, source in tensors.items():
        renamed, _ = rename_source_key(name, renamings, [], reverse=False)
        for converter in converters:
            target, pattern = converter.rename_source_key(renamed)
            if pattern is not None:
                target, _ = rename_source_key(target, [], [], base_model_prefix=base, meta_state_dict=known)
                groups.setdefault((id(converter), target), {}).setdefault(pattern, []).append((renamed, name, source))
                used[id(converter)] = converter
                break
        else:
            final, _ = rename_source_key(renamed, [], [], base_model_prefix=base, meta_state_dict=known)
            out[final] = source
    for (ident, target), by_pattern in groups.items():
        out.update(_convert(used[ident], target, by_pattern, module))
    return out


def _convert(converter: Any, target: str, by_pattern: dict[str, list[tuple[str, str, Any]]], module: nn.Module) -> dict[str, Any]:
    """The model tensors that ``converter`` makes of these checkpoint tensors, as range readers."""
    rule = f"{type(converter).__name__}({converter.source_patterns} -> {converter.target_patterns}, {converter.operations})"
    first = next(iter(by_pattern.values()))[0][1]
    state: dict[str, list[Any]] = {}
    for pattern, found in by_pattern.items():
        state[pattern] = _in_index_order(pattern, found, target, rule)
    for op in converter.operations:
        kind = type(op).__name__
        if kind == "MergeModulelist":
            state = {p: [Joined(pieces, op.dim, f"{target} ({p}: {len(pieces)} tensors stacked)", stack=True)]
                     for p, pieces in state.items()}  # fmt: skip
        elif kind == "Concatenate":
            pieces = [piece for p in converter.source_patterns for piece in state.get(p, [])]
            state = {converter.target_patterns[0]: [Joined(pieces, op.dim, f"{target} ({len(pieces)} tensors joined)")]}
        elif kind == "Chunk" and len(state) == 1 and len(next(iter(state.values()))) == 1:
            whole = next(iter(state.values()))[0]
            names = op.get_target_patterns(list(converter.target_patterns), config=getattr(module, "config", None))
            total = whole.shape[op.dim]
            step = -(-total // len(names))
            state = {n: [Part(whole, op.dim, i * step, min(step, total - i * step), f"{target} (part {i} of {first})")]
                     for i, n in enumerate(names)}  # fmt: skip
        else:
            raise CheckpointMismatchError(
                f"zero3: load_pretrained: {first!r} becomes {target!r} through transformers' rule {rule}, whose "
                f"operation {kind} zero3 cannot read by range (it reads {list(SLICEABLE)}); nothing was loaded. "
                "Load this model with from_pretrained, or convert the checkpoint once with from_pretrained + "
                "save_full_weights(..., fmt='safetensors') and load that."
            )
    if any(len(pieces) != 1 for pieces in state.values()):
        raise CheckpointMismatchError(f"zero3: load_pretrained: transformers' rule {rule} leaves several tensors for "
                                      f"{target!r} (from {first!r}); nothing was loaded.")  # fmt: skip
    if len(state) == 1 and len(converter.target_patterns) == 1:
        state = {converter.target_patterns[0]: next(iter(state.values()))}
    head, found, tail = target.partition(converter.target_patterns[0])
    if not found:
        head, tail = "", ""
    return {head + pattern + tail: pieces[0] for pattern, pieces in state.items()}


def _in_index_order(pattern: str, found: list[tuple[str, str, Any]], target: str, rule: str) -> list[Any]:
    """The sources matched by ``pattern`` in the order of the index its ``*`` stands for (0..E-1, checked)."""
    if "*" not in pattern:
        if len(found) > 1:
            raise CheckpointMismatchError(f"zero3: load_pretrained: {[f[1] for f in found]} all become {target!r} "
                                          f"through {rule}; nothing was loaded.")  # fmt: skip
        return [found[0][2]]
    index = re.compile(pattern.replace("*.", r"(\d+)\."))
    numbered = []
    for renamed, name, source in found:
        match = index.search(renamed)
        if match is None:
            raise CheckpointMismatchError(f"zero3: load_pretrained: cannot read the index in {name!r} ({rule}).")
        numbered.append((int(match.group(1)), name, source))
    numbered.sort(key=lambda item: item[0])
    indices = [i for i, _, _ in numbered]
    if indices != list(range(len(indices))):
        missing = sorted(set(range(max(indices) + 1)) - set(indices))
        raise CheckpointMismatchError(
            f"zero3: load_pretrained: {target!r} is joined from {len(indices)} checkpoint tensors matching {pattern!r} "
            f"with indices {indices[:16]}, which are not 0..{len(indices) - 1} (missing {missing[:8]} or repeated); "
            f"the checkpoint is incomplete or not this model's. Nothing was loaded."
        )
    return [source for _, _, source in numbered]


def _class_renames(module: nn.Module, tensors: Mapping[str, Any]) -> dict[str, Any]:
    """transformers 4.5x: ``_checkpoint_conversion_mapping`` (the first pattern that matches renames)."""
    mapping = getattr(module, "_checkpoint_conversion_mapping", None) or {}
    out = {}
    for name, source in tensors.items():
        for pattern, replacement in mapping.items():
            renamed, count = re.subn(pattern, replacement, name)
            if count:
                name = renamed
                break
        out[name] = source
    return out
