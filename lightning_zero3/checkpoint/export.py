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
import uuid
from pathlib import Path
from typing import Iterator, Optional, Union

import torch
from torch import nn

from ..engine import Zero3Engine
from ..engine.engine import _ENGINE_ATTR, engine_of
from .hf import DEFAULT_MAX_SHARD, find_hf_model, hf_configuration, write_hf_directory
from .writers import TensorEntry, write_safetensors, write_torch

FORMATS = ("pt", "safetensors", "hf")


def _engine_for(module: nn.Module) -> Optional[Zero3Engine]:
    engine = engine_of(module)
    if engine is not None:
        return engine
    for p in module.parameters():  # a submodule of a sharded module
        ref = getattr(p, _ENGINE_ATTR, None)
        if ref is not None and ref() is not None:
            return ref()
    return None


def save_full_weights(
    module: nn.Module, path: Union[str, "os.PathLike[str]"], prefix: Optional[str] = None, fmt: Optional[str] = None,
    max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD,
) -> Path:
    """Write ``module``'s full weights (its ``state_dict``, parameters in the master dtype) to ``path``.

    ``fmt``: ``"pt"`` (``torch.save`` format), ``"safetensors"``, or ``"hf"``: a Hugging Face model
    directory for a module that wraps a ``transformers`` model (``config.json`` and safetensors files,
    split above ``max_shard_size``; see ``hf.py``); by default from the suffix (a path without one is a
    Hugging Face directory when the module wraps such a model). ``prefix``: keep only the names that start
    with it, without it (``prefix="model."`` turns a LightningModule's ``model.wte.weight`` into
    ``wte.weight``; for ``"hf"`` the wrapped model's own names are the default). Call it on every rank
    (rank 0 writes); works on modules that are not sharded too."""
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
    engine = _engine_for(module)
    writing = engine is None or engine.comm.rank == 0
    entries, values = _plan(module, engine, prefix)
    if not entries:
        raise ValueError(f"zero3: no tensor of the module has a name starting with {prefix!r}.")
    staging = path.with_name(f".{path.name}.partial-{uuid.uuid4().hex[:8]}")
    error: Optional[str] = None
    try:
        if writing and fmt == "hf":
            assert hf is not None
            write_hf_directory(path, entries, values, hf_configuration(hf[1]), max_shard_size)
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
        if engine is None or engine.comm.world_size == 1:
            raise
        for _ in values:  # the other ranks still gather the remaining units: take part
            pass
    finally:
        staging.unlink(missing_ok=True)
    if engine is not None and engine.comm.world_size > 1:
        errors = [e for e in engine.comm.all_gather_objects(error) if e]
        if errors:
            raise RuntimeError(f"zero3: writing full weights to {path} failed on rank 0: {errors[0]}")
    return path


def _plan(module: nn.Module, engine: Optional[Zero3Engine], prefix: str) -> tuple[list[TensorEntry], Iterator[torch.Tensor]]:
    """The file's tensors, in the order their values come: the engine's units one after the other, then
    buffers and anything not sharded."""
    own = module.state_dict(keep_vars=True)
    names_of: dict[int, list[str]] = {}
    for name, value in own.items():
        if name.startswith(prefix):
            names_of.setdefault(id(value), []).append(name[len(prefix) :])
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
        for group, slots in units:
            with group.gathered_master() as master:
                for slot in slots:
                    yield master[slot.offset : slot.offset + slot.numel].view(slot.param.shape).cpu()
        done: set = set()
        for key, value in plain:
            if id(value) not in done:
                done.add(id(value))
                yield value.detach().cpu()

    return entries, values()
