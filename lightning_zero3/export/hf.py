"""Hugging Face model directories: trained weights straight to ``from_pretrained`` (and so to vLLM, TGI or
TensorRT-LLM, which read the same layout).

A LightningModule that wraps a Hugging Face model (any ``transformers.PreTrainedModel`` attribute, e.g.
``self.model = AutoModelForCausalLM.from_config(config)``) is exported as the directory ``save_pretrained``
writes: ``config.json`` (and ``generation_config.json`` when the model has one), the weights under the
Hugging Face model's own names in safetensors files, one ``model.safetensors`` below ``max_shard_size``,
else ``model-00001-of-0000N.safetensors`` ... with ``model.safetensors.index.json`` mapping every name to
its file, and ``SHA256SUMS``: the SHA-256 of every other file (what the Hub records per file), taken from
the bytes as they are written, checked by ``lightning-zero3 verify DIR`` or ``sha256sum -c SHA256SUMS``.
Tensors are written one at a time as they arrive (gathered unit by unit from a live run, or read
from a sharded checkpoint), so no process holds the model. A tied weight is stored once, under the name
``save_pretrained`` keeps (the model's ``_tied_weights_keys`` dropped, e.g. Gemma's ``lm_head.weight``;
``from_pretrained`` ties it again); with transformers 4.5x, under each of its names.

The weights are written in the checkpoint's own Hub layout, as ``save_pretrained`` writes them: transformers'
conversion rules reversed (``to_hub_layout``: Mixtral's fused ``experts.gate_up_proj`` back to one ``w1`` /
``w3`` per expert, LLaVA's ``model.language_model.*`` back to ``language_model.model.*``). When the model
came from a local directory (``config._name_or_path``), its ``config.json``, ``generation_config.json``
and tokenizer / processor files are copied verbatim (re-saving them with transformers 5 rewrites fields
older serving stacks misread), so a serving engine loads the export as it loads the original.

Sharded checkpoints of such a module carry its configuration (``hf_config.json``), so
``zero3-consolidate CKPT OUT --format hf`` needs nothing else.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import torch
from torch import nn

from .digests import SHA256, bytes_digest, new_digest
from .writers import TensorEntry, staging_path, write_safetensors

DEFAULT_MAX_SHARD = "5GB"  # save_pretrained's default
HF_CONFIG = "hf_config.json"  # inside a sharded checkpoint: {"prefix": ..., "config": ..., "generation_config": ...}
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
SHA256SUMS = "SHA256SUMS"  # every other file's SHA-256, in ``sha256sum``'s format (``sha256sum -c SHA256SUMS``)


def find_hf_model(module: nn.Module) -> Optional[tuple[str, nn.Module]]:
    """The first Hugging Face model inside ``module`` and the ``state_dict`` prefix of its names (``"model."``
    for ``self.model``), or None. Looks only when ``transformers`` was imported by the program."""
    if "transformers" not in sys.modules:
        return None
    from transformers import PreTrainedModel

    for name, sub in module.named_modules():
        if isinstance(sub, PreTrainedModel):
            return (f"{name}." if name else ""), sub
    return None


def hf_configuration(model: nn.Module) -> dict[str, Any]:
    """What ``config.json`` (and ``generation_config.json``) say about ``model``."""
    saved = {"config": json.loads(model.config.to_json_string())}
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        saved["generation_config"] = json.loads(generation.to_json_string())
    return saved


SOURCE_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
    "preprocessor_config.json", "processor_config.json",
)  # fmt: skip


def source_directory(model: nn.Module) -> Optional[Path]:
    """The local directory ``model`` was loaded from (``from_pretrained`` / ``AutoConfig.from_pretrained``), if any."""
    name = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    path = Path(name) if name else None
    return path if path is not None and (path / "config.json").is_file() else None


def to_hub_layout(
    model: nn.Module, entries: list[TensorEntry], values: Iterator[torch.Tensor]
) -> tuple[list[TensorEntry], Iterator[torch.Tensor]]:
    """``entries`` / ``values`` under the model's names turned into its Hub checkpoint's, by transformers' rules
    reversed (``revert_weight_conversion``, what ``save_pretrained`` does), one tensor at a time: the names and
    shapes first (worked out on meta tensors), then each value split as it arrives."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4.5x: save_pretrained writes the model's own names
        return entries, values
    entries = [_untied(model, entry) for entry in entries]
    out: list[TensorEntry] = []
    split: list[bool] = []
    for entry in entries:
        meta = torch.empty(entry.shape, dtype=entry.dtype, device="meta")
        reverted = revert_weight_conversion(model, {name: meta for name in entry.names})
        if len(reverted) == len(entry.names) and all(list(v.shape) == list(entry.shape) for v in reverted.values()):
            out.append(TensorEntry(list(reverted), entry.shape, entry.dtype))  # renamed only
            split.append(False)
        else:  # one fused tensor into several (one name: aliases of a fused tensor do not occur)
            out.extend(TensorEntry([name], list(v.shape), entry.dtype) for name, v in reverted.items())
            split.append(True)

    def pieces() -> Iterator[torch.Tensor]:
        for entry, value, fused in zip(entries, values, split):
            if not fused:
                yield value
                continue
            yield from (v.contiguous() for v in revert_weight_conversion(model, {entry.names[0]: value}).values())

    return out, pieces()


def _untied(model: nn.Module, entry: TensorEntry) -> TensorEntry:
    """``entry`` less the aliases ``save_pretrained`` drops (``remove_tied_weights_from_state_dict``: names that
    match a ``_tied_weights_keys`` pattern, in sorted order, all but the last of the aliases)."""
    if len(entry.names) < 2:
        return entry
    from transformers.modeling_utils import _get_tied_weight_keys

    patterns = set(_get_tied_weight_keys(model))
    dropped, found = set(), 0
    for name in sorted(entry.names):
        if any(re.search(pattern, name) for pattern in patterns):
            found += 1
            if found < len(entry.names):
                dropped.add(name)
    return TensorEntry([n for n in entry.names if n not in dropped], entry.shape, entry.dtype) if dropped else entry


def write_sha256sums(directory: Path, sums: dict[str, str]) -> None:
    """The export's manifest: one ``<sha256>  <file>`` line per file, as ``sha256sum`` writes and checks them."""
    (directory / SHA256SUMS).write_text("".join(f"{digest}  {name}\n" for name, digest in sorted(sums.items())))


def read_sha256sums(directory: Path) -> dict[str, str]:
    sums = {}
    for line in (directory / SHA256SUMS).read_text().splitlines():
        if line.strip():
            digest, name = line.split(maxsplit=1)
            sums[name.lstrip("*")] = digest
    return sums


def parse_size(size: Union[int, str]) -> int:
    """Bytes from an int or a string such as ``"5GB"``, ``"500MiB"``, ``"2e9"``."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]?i?B?)?\s*", str(size))
    if not match:
        raise ValueError(f"zero3: cannot read {size!r} as a size; write bytes or e.g. '5GB', '500MiB'.")
    number, unit = float(match.group(1)), (match.group(2) or "").upper()
    base = 1024 if "I" in unit else 1000
    power = {"": 0, "B": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit[:1] if unit[:1] in "KMGT" else ""]
    return int(number * base**power)


def write_hf_directory(
    out: Path, entries: list[TensorEntry], values: Iterator[torch.Tensor], configuration: dict[str, Any],
    max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD, source: Optional[Path] = None,
) -> Path:
    """Write a Hugging Face directory at ``out`` (replacing one that is there, atomically); ``source``: the
    checkpoint directory whose config, generation config and tokenizer files are copied verbatim."""
    limit = parse_size(max_shard_size)
    shards: list[list[TensorEntry]] = [[]]
    size = 0
    for entry in entries:
        nbytes = entry.nbytes * len(entry.names)
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    staging = staging_path(out)
    staging.mkdir(parents=True)
    try:
        names = [WEIGHTS] if len(shards) == 1 else [
            f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
        ]  # fmt: skip
        sums: dict[str, str] = {}  # file -> SHA-256, taken from the bytes as they are written
        for name, shard in zip(names, shards):
            digest = new_digest(SHA256)
            write_safetensors(staging / name, shard, itertools.islice(values, len(shard)), digest=digest)
            sums[name] = digest.hexdigest()
        small: dict[str, bytes] = {}
        if len(shards) > 1:
            weight_map = {n: file for file, shard in zip(names, shards) for e in shard for n in e.names}
            total = sum(e.nbytes * len(e.names) for e in entries)
            small[INDEX] = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2).encode()
        small["config.json"] = json.dumps(configuration["config"], indent=2).encode()
        if "generation_config" in configuration:
            small["generation_config.json"] = json.dumps(configuration["generation_config"], indent=2).encode()
        for name in SOURCE_FILES if source is not None else ():
            if (source / name).is_file():
                small[name] = (source / name).read_bytes()  # copied verbatim
        for name, content in small.items():
            (staging / name).write_bytes(content)
            sums[name] = bytes_digest(content, SHA256)
        write_sha256sums(staging, sums)
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        os.replace(staging, out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return out
