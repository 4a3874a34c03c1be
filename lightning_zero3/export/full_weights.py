"""Full weights from a live run, unit by unit: ``save_full_weights(module, "model.safetensors")``.

A collective (every rank calls it): the units are gathered one after the other in the master dtype
(``FlatGroup.gathered_master``), rank 0 writes each parameter's bytes as soon as its unit is there, and
the unit's buffer goes before the next one is gathered. So no rank holds more than about one unit of the
model, and the file holds the module's own ``state_dict`` names (tied weights under each name), loadable
by plain torch (``.pt``, with ``torch.load(..., weights_only=True)``) or by safetensors. The file appears
whole or not at all; an error on the writing rank reaches every rank.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from ..engine import Zero3Engine
from ..engine.comm.collective_log import EXPORT_FIX, collective, in_phase
from ..engine.engine import owning_engine
from .adapters import LoraMerge, adapter_values, lora_merge, merged
from .hf import DEFAULT_MAX_SHARD, find_hf_model, hf_configuration, source_directory, to_hub_layout, write_hf_directory
from .writers import TensorEntry, failures_everywhere, staging_path, write_safetensors, write_torch

FORMATS = ("pt", "safetensors", "hf")


@in_phase("save_full_weights", EXPORT_FIX)
def save_full_weights(
    module: nn.Module, path: Union[str, "os.PathLike[str]"], prefix: Optional[str] = None, fmt: Optional[str] = None,
    max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD, merge_adapters: Optional[bool] = None,
) -> Path:
    """Write ``module``'s full weights (its ``state_dict``, parameters in the master dtype) to ``path``.

    ``fmt``: ``"pt"`` (``torch.save`` format), ``"safetensors"``, or ``"hf"``: a Hugging Face model
    directory for a module that wraps a ``transformers`` model (``config.json`` and safetensors files,
    split above ``max_shard_size``, in the checkpoint's Hub layout, with the source directory's config and
    tokenizer files copied; see ``hf.py``); by default from the suffix (a path without one is a
    Hugging Face directory when the module wraps such a model). ``prefix``: keep only the names that start
    with it, without it (``prefix="model."`` turns a LightningModule's ``model.wte.weight`` into
    ``wte.weight``; for ``"hf"`` the wrapped model's own names are the default). ``merge_adapters``
    (default: for ``"hf"``): peft LoRA adapters are added into their base weights and not written, so a
    fine-tuned ``PeftModel`` exports as the merged Hugging Face model (``adapters.py``). Call it on every
    rank (rank 0 writes); works on modules that are not sharded too."""
    path = Path(path)
    hf = find_hf_model(module)
    fmt = fmt or ("safetensors" if path.suffix == ".safetensors" else "pt" if path.suffix or hf is None else "hf")
    if fmt not in FORMATS:
        raise ValueError(f"zero3: unknown weights format {fmt!r}; use one of {list(FORMATS)}.")
    if fmt == "hf" and hf is None:
        raise ValueError(
            "zero3: fmt='hf' needs a Hugging Face model (a transformers.PreTrainedModel) inside the module; "
            "use fmt='safetensors' or 'pt' for other models."
        )
    if prefix is None:
        prefix = hf[0] if fmt == "hf" and hf is not None else ""
    engine = owning_engine(module)
    rank, world = _ranks(engine)  # under DDP too: one rank writes, the others wait for its outcome
    writing = rank == 0
    merge = lora_merge(module) if (fmt == "hf" if merge_adapters is None else merge_adapters) else None
    entries, values = _plan(module, engine, prefix, merge)
    if not entries:
        raise ValueError(f"zero3: no tensor of the module has a name starting with {prefix!r}.")
    staging = staging_path(path)
    error: Optional[str] = None
    try:
        if writing and fmt == "hf":
            assert hf is not None
            entries, values = to_hub_layout(hf[1], entries, values)
            write_hf_directory(path, entries, values, hf_configuration(hf[1]), max_shard_size, source_directory(hf[1]))
        elif writing:
            path.parent.mkdir(parents=True, exist_ok=True)
            writer = write_safetensors if fmt == "safetensors" else write_torch
            writer(staging, entries, values)
            os.replace(staging, path)
        else:
            for _ in values:  # take part in every unit's gather
                pass
    except Exception as failure:  # noqa: BLE001 - reported to every rank below
        error = f"{type(failure).__name__}: {failure}"
        if world == 1:
            raise
        for _ in values:  # the other ranks still gather the remaining units: take part
            pass
    finally:
        staging.unlink(missing_ok=True)
    if world > 1:
        causes = failures_everywhere(error, lambda obj: _all_gather_objects(engine, obj))
        if causes:
            rank, cause = min(causes.items())
            raise RuntimeError(f"zero3: writing full weights to {path} failed on rank {rank}: {cause}")
    return path


def _ranks(engine: Optional[Zero3Engine]) -> tuple[int, int]:
    if engine is not None:
        return engine.comm.rank, engine.comm.world_size
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_gather_objects(engine: Optional[Zero3Engine], obj) -> list:
    if engine is not None:
        return engine.comm.all_gather_objects(obj)
    everyone = [None] * dist.get_world_size()
    with collective("world", "all-gather of Python objects"):
        dist.all_gather_object(everyone, obj)
    return everyone


def _plan(
    module: nn.Module, engine: Optional[Zero3Engine], prefix: str, merge: Optional[LoraMerge] = None
) -> tuple[list[TensorEntry], Iterator[torch.Tensor]]:
    """The file's tensors, in the order their values come: the engine's units one after the other, then
    buffers and anything not sharded. With ``merge``, LoRA adapters are added into their base weights
    (``adapters.py``)."""
    own = module.state_dict(keep_vars=True)
    names_of: dict[int, list[str]] = {}
    for name, value in own.items():
        exported = merge.exported_name(name) if merge is not None else name
        if exported is not None and exported.startswith(prefix):
            names_of.setdefault(id(value), []).append(exported[len(prefix) :])
    sharded = engine.slots if engine is not None else {}
    entries: list[TensorEntry] = []
    units = []
    if engine is not None:
        for runtime in engine.runtimes:
            slots = [slot for slot in runtime.group.slots if id(slot.param) in names_of]
            if slots:
                units.append((runtime.group, slots))
                for slot in slots:
                    entries.append(TensorEntry(names_of[id(slot.param)], list(slot.param.shape), runtime.group.dtype))
    plain = [(key, value) for key, value in own.items() if id(value) not in sharded and id(value) in names_of]
    seen: set = set()
    for key, value in plain:
        if id(value) not in seen:
            seen.add(id(value))
            entries.append(TensorEntry(names_of[id(value)], list(value.shape), value.dtype))

    def values() -> Iterator[torch.Tensor]:
        adapters = adapter_values(merge, engine) if merge is not None else {}

        def final(key: int, value: torch.Tensor) -> torch.Tensor:
            if merge is not None and key in merge.deltas:
                value = merged(value, merge.deltas[key], adapters)
            return value.cpu()

        for group, slots in units:
            with group.gathered_master() as master:
                for slot in slots:
                    yield final(id(slot.param), master[slot.offset : slot.offset + slot.numel].view(slot.param.shape))
        done: set = set()
        for key, value in plain:
            if id(value) not in done:
                done.add(id(value))
                yield final(id(value), value.detach())

    return entries, values()
