"""Which checkpoint tensor goes into which tensor of the model, checked before anything is read.

Names: a checkpoint name is kept only if it starts with ``prefix`` (which is then removed: a Lightning
checkpoint's ``model.`` in front of a wrapped model's names), then renamed by ``key_map`` (a dict of
old -> new names, or a function returning the new name or None to skip it). The model's names are its
``state_dict`` names: parameters and persistent buffers. A tensor the model holds under several names
(tied weights: ``lm_head.weight`` is ``model.embed_tokens.weight``) is satisfied by any of them, as a
Hugging Face checkpoint stores it once.

A Hugging Face model's Hub names and fused tensors are then turned into its own by transformers' rules
(``conversions.py``), after ``prefix`` and ``key_map``.

Under ``strict`` every model tensor must be found and every kept checkpoint name must be the model's;
a shape that differs is an error either way (a checkpoint of another model). A Hugging Face model's own
lists of names to ignore on load (``_keys_to_ignore_on_load_missing`` / ``_unexpected``) are honoured,
as ``from_pretrained`` does.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping, Optional, Union

import torch
from torch import nn

from ..checkpoint.sharded import CheckpointMismatchError
from ..engine.layout.sources import PendingValues
from .conversions import to_model_names

KeyMap = Optional[Union[Mapping[str, str], Callable[[str], Optional[str]]]]
SHOWN = 8  # names listed per kind of problem in an error


def model_tensors(module: nn.Module) -> tuple[dict[str, tuple], dict[tuple, torch.Size]]:
    """The model's state dict names -> the tensor each is (``("param", id)`` or ``("buffer", (id of
    module, name))``), and each tensor's shape. Works on meta, real and sharded models alike."""
    params = {id(p) for p in module.parameters()}
    buffer_of = {
        id(b): (id(owner), name)
        for owner in module.modules()
        for name, b in owner._buffers.items()
        if b is not None
    }  # fmt: skip
    names: dict[str, tuple] = {}
    shapes: dict[tuple, torch.Size] = {}
    for name, value in module.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor):
            continue
        key = ("param", id(value)) if id(value) in params else ("buffer", buffer_of.get(id(value)))
        if key[1] is None:
            continue
        names[name] = key
        shapes[key] = value.shape
    return names, shapes


def match(module: nn.Module, tensors: Mapping[str, Any], prefix: str = "", key_map: KeyMap = None,
          strict: bool = True, adapter: bool = False) -> tuple[PendingValues, list[str]]:  # fmt: skip
    """The sources for ``module``'s tensors, and the model names the checkpoint left out (``strict=False``).
    ``adapter``: a peft adapter checkpoint: only the model's LoRA tensors are expected, and the stored
    names get the adapter's name (``...lora_A.weight`` -> ``...lora_A.default.weight``), as peft's own
    loading does, before ``key_map`` applies."""
    names, shapes = model_tensors(module)
    if adapter:
        names = {name: key for name, key in names.items() if LORA in name}
        key_map = _after(_with_adapter_name, key_map)
    ignore_missing, ignore_unexpected = _hugging_face_ignores(module)
    found: dict[tuple, Any] = {}
    unexpected, mismatched = [], []
    renamed: dict[str, Any] = {}
    for stored, source in tensors.items():
        if not stored.startswith(prefix):
            continue
        name = _rename(stored[len(prefix) :], key_map)
        if name is not None:
            renamed[name] = source
    if not adapter:  # the Hub layout into the model's (transformers' own rules; conversions.py)
        renamed = to_model_names(module, renamed, names)
    for name, source in renamed.items():
        key = names.get(name)
        if key is None:
            if not any(p.search(name) for p in ignore_unexpected):
                unexpected.append(name)
            continue
        if tuple(source.shape) != tuple(shapes[key]):
            mismatched.append(f"{name}: checkpoint {list(source.shape)}, model {list(shapes[key])}")
            continue
        found.setdefault(key, source)
    by_key: dict[tuple, list[str]] = {}
    for name, key in names.items():
        by_key.setdefault(key, []).append(name)
    missing = [
        " = ".join(aliases) for key, aliases in by_key.items()
        if key not in found and not any(p.search(a) for a in aliases for p in ignore_missing)
    ]  # fmt: skip
    if mismatched or (strict and (missing or unexpected)):
        kept = [n[len(prefix) :] for n in tensors if n.startswith(prefix)]
        shown = (missing, unexpected) if strict else ([], [])
        raise CheckpointMismatchError(_describe(*shown, mismatched, list(names), kept or list(tensors)))
    values = PendingValues()
    for (kind, ident), source in found.items():
        if kind == "param":
            values.params[ident] = source
        else:
            values.buffers[ident] = source
    return values, missing


LORA = "lora_"  # what peft's LoRA tensors have in their names
DEFAULT_ADAPTER = "default"


def _with_adapter_name(name: str) -> str:
    """A peft adapter file's name with the adapter's name put back: ``q_proj.lora_A.weight`` ->
    ``q_proj.lora_A.default.weight`` (peft leaves it out of the files it saves)."""
    head, found, tail = name.rpartition(LORA)
    if not found:
        return name
    module, dot, rest = tail.partition(".")
    return f"{head}{LORA}{module}.{DEFAULT_ADAPTER}.{rest}" if dot else f"{name}.{DEFAULT_ADAPTER}"


def _after(first: Callable[[str], Optional[str]], then: KeyMap) -> Callable[[str], Optional[str]]:
    return lambda name: _rename(first(name), then)


def _rename(name: str, key_map: KeyMap) -> Optional[str]:
    if key_map is None:
        return name
    if callable(key_map):
        return key_map(name)
    return key_map.get(name, name)


def _hugging_face_ignores(module: nn.Module) -> tuple[list[re.Pattern], list[re.Pattern]]:
    patterns = []
    for attribute in ("_keys_to_ignore_on_load_missing", "_keys_to_ignore_on_load_unexpected"):
        patterns.append([re.compile(p) for p in (getattr(module, attribute, None) or [])])
    return patterns[0], patterns[1]


def _describe(missing: list[str], unexpected: list[str], mismatched: list[str], model: list[str], stored: list[str]) -> str:
    parts = []
    for label, names in (("shapes that differ", mismatched), ("missing from the checkpoint", missing),
                         ("in the checkpoint but not in the model", unexpected)):  # fmt: skip
        if names:
            more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
            parts.append(f"{len(names)} {label}: {names[:SHOWN]}{more}")
    message = "zero3: load_pretrained: the checkpoint does not fit the model; " + "; ".join(parts) + "."
    hint = _prefix_hint(model, stored)
    if hint:
        message += " " + hint
    elif missing or unexpected:
        message += (" Pass `strict=False` to load what fits (the rest keeps its initial values), or `key_map=` "
                    "to rename the checkpoint's tensors.")  # fmt: skip
    return message


def _prefix_hint(model: list[str], stored: list[str]) -> str:
    """A prefix that would make the names agree: the checkpoint's names carry one the model's lack, or
    the other way round (a LightningModule passed where its wrapped model was meant)."""
    model_set, stored_set = set(model), set(stored)
    if not model_set or model_set & stored_set:
        return ""
    for name in stored:
        head = name.split(".", 1)[0] + "."
        if {n[len(head) :] for n in stored if n.startswith(head)} & model_set:
            return f"The checkpoint's names start with {head!r}, which the model's do not: pass `prefix={head!r}`."
    for name in model:
        head = name.split(".", 1)[0] + "."
        if {n[len(head) :] for n in model if n.startswith(head)} & stored_set:
            return (f"The model's names start with {head!r}, which the checkpoint's do not: load into the "
                    f"submodule under {head[:-1]!r} (e.g. `load_pretrained(self.{head[:-1]}, path)`).")  # fmt: skip
    return ""
