"""``load_pretrained(module, path)``: a pretrained checkpoint into a model, each rank reading only its shards.

Where it is called decides what it does, and the result is the same model:
- on a model built on the meta device (``configure_model`` under zero3, or ``init_module(empty_init=True)``):
  the checkpoint is checked now and its tensors are left on the model; the engine that shards it
  builds the units from them without initialising or broadcasting anything, each rank copying only
  the byte ranges of its own shards (see [Note: loading straight into shards] in engine/layout/sources.py).
  Called inside the block that builds the model, no random number is drawn for what the checkpoint
  holds, and what it lacks gets what ``from_pretrained`` gives it ([Note: draws wait for a load] in
  engine/layout/materialize.py);
- on a model zero3 has sharded already (after ``fit``, in a hook): each rank copies its pieces into its
  shards now;
- on an ordinary model (DDP, one device, ``__init__``): the tensors are copied in whole, so the same
  code runs under any strategy.

Every problem that can be known before a weight is read (a path that is not there, a truncated or
corrupt file, an index that names a missing file, names or shapes that do not fit the model) is raised
before any weight changes, and with several ranks a failure on one fails all of them, naming the rank.
"""

from __future__ import annotations

import logging
import os
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint.atomic import CheckpointError
from ..engine.engine import Zero3Engine, owning_engine
from ..engine.layout import sources
from ..engine.layout.materialize import drawn_elements, has_meta_tensors
from ..engine.layout.sources import PendingValues, read_whole
from ..engine.state.loading import load_sources
from .matching import KeyMap, match
from .missing import loaded_as_from_pretrained
from .tensor_files import open_checkpoint

log = logging.getLogger(__name__)


class PeerLoadError(RuntimeError):
    """``load_pretrained`` failed on another rank (this rank raises it so that none goes on alone)."""


def load_pretrained(
    module: nn.Module,
    path: Union[str, "os.PathLike[str]"],
    *,
    prefix: str = "",
    strict: bool = True,
    key_map: KeyMap = None,
) -> nn.Module:
    """Load the pretrained weights at ``path`` into ``module`` and return ``module``.

    ``path``: a Hugging Face model directory (``model.safetensors``, or shards listed by
    ``model.safetensors.index.json``; ``pytorch_model.bin`` alike), one ``.safetensors`` file, or a torch
    state dict (``.pt`` / ``.pth`` / ``.bin``; a Lightning ``.ckpt``'s ``state_dict``), zero3's own
    exports included; or a peft adapter directory (``PeftModel.save_pretrained``'s) into a ``PeftModel``,
    which loads its LoRA tensors only (adapter ``"default"``). Values are cast to the model's dtypes (a
    bf16 checkpoint into fp32 masters).
    ``prefix``: only checkpoint names that start with it, without it. ``key_map``: renames checkpoint
    names (after ``prefix``) to the model's, a dict or a function (None skips the tensor).
    ``strict``: every tensor of the model must be found and every kept checkpoint name must be the
    model's; with ``strict=False`` what is missing keeps its initial values (logged). Shapes must agree.

    Call it on every rank (each reads its own part). Under zero3, in ``configure_model`` (where nothing is
    then drawn for the checkpoint's tensors; for a Hugging Face model ``from_pretrained(AutoModel..., path)``
    does both in one call)::

        config = AutoConfig.from_pretrained(path)
        self.model = load_pretrained(AutoModelForCausalLM.from_config(config), path)
    """
    engine = owning_engine(module)
    error: Optional[BaseException] = None
    values, missing, checkpoint = PendingValues(), [], None
    try:
        checkpoint = open_checkpoint(path)
        values, missing = match(module, checkpoint.tensors, prefix, key_map, strict, checkpoint.adapter)
        values.keep.append(checkpoint)
    except (CheckpointError, ValueError, OSError) as failure:
        error = failure
    _agree(error, engine)
    if missing:
        log.warning("zero3: load_pretrained(%s): %d tensors are not in the checkpoint and keep the model's own "
                    "initialisation: %s", path, len(missing), missing[:8])  # fmt: skip
    if engine is not None:
        try:
            load_sources(engine, values)
        finally:
            checkpoint.close()
    elif has_meta_tensors(module):
        _warn_if_drawn(module, values, path)
        with loaded_as_from_pretrained(module, values.params.keys(), values.buffers.keys(), checkpoint.adapter):
            sources.attach(module, values)  # read by the engine that shards it (the checkpoint stays open)
    else:
        try:
            _copy_whole(module, values)
        finally:
            checkpoint.close()
    return module


def _warn_if_drawn(module: nn.Module, values: PendingValues, path) -> None:
    """The model's construction drew random numbers for tensors this checkpoint overwrites: it was built
    before the load was known (see [Note: draws wait for a load] in engine/layout/materialize.py)."""
    loaded = [p for p in module.parameters() if id(p) in values.params]
    drawn = drawn_elements(loaded)
    if drawn:
        log.warning(
            "zero3: load_pretrained(%s): building this model drew %d random numbers on every rank for tensors "
            "the checkpoint overwrites. Build and load it in one call, `lightning_zero3.from_pretrained("
            "AutoModel..., path)`, or call load_pretrained inside the block that builds it (`configure_model`, "
            "`with fabric.init_module(empty_init=True):`, `with trainer.init_module(empty_init=True):`), and "
            "those draws are skipped.", path, drawn,
        )  # fmt: skip


def _copy_whole(module: nn.Module, values: PendingValues) -> None:
    """An ordinary model: every tensor is read whole into place."""
    params = {id(p): p for p in module.parameters()}
    owners = {id(m): m for m in module.modules()}
    with torch.no_grad():
        for ident, source in values.params.items():
            read_whole(source, params[ident].data)
            source.release()
        for (owner, name), source in values.buffers.items():
            read_whole(source, owners[owner]._buffers[name])
            source.release()


def _agree(error: Optional[BaseException], engine: Optional[Zero3Engine]) -> None:
    """Raise ``error`` here, or the first other rank's failure, on every rank (one small exchange)."""
    message = None if error is None else f"{type(error).__name__}: {error}"
    if engine is not None and engine.comm.world_size > 1:
        everyone = engine.comm.all_gather_objects(message)
    elif dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, message)
    else:
        everyone = [message]
    if error is not None:
        raise error
    failed = [(rank, m) for rank, m in enumerate(everyone) if m]
    if failed:
        rank, text = failed[0]
        raise PeerLoadError(f"zero3: load_pretrained failed on rank {rank}: {text}")
