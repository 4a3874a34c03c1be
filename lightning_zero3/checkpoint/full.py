"""Single-file checkpoints (``checkpoint_format="full"``): what DDP saves, written unit by unit.

The file is an ordinary Lightning checkpoint (``torch.save`` format: full weights under the module's own
names, the unsharded optimizer state, and Lightning's loops, callbacks, schedulers), so DDP and plain
torch load it as their own. It is written as described in [Note: a torch.save file, tensor by tensor]
(``export/writers.py``): every rank takes part in gathering one unit's weights, then one state key of that
unit at a time, rank 0 writes them and the buffers go before the next; no rank ever holds the whole
model or its optimizer state. The file appears whole or not at all, and a failure on rank 0 reaches
every rank.

Loading reads the file memory-mapped: each rank copies its slice of every tensor and drops the pages it
read (``engine.load_full_state_dict``, ``load_full_optimizer_state``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..engine import Zero3Engine
from ..engine.state.optimizer_state import full_state_layout, gathered_state
from .api import agree_on_outcome
from .atomic import fsync_path
from ..export.writers import TensorEntry, TorchFileWriter, placeholder, staging_path

#: what ``lightning_module_state_dict`` / ``optimizer_state`` hand Lightning in full mode: the values are
#: written by ``save_full_checkpoint`` as they are gathered
STREAMED = "zero3: written unit by unit by save_full_checkpoint"


def save_full_checkpoint(
    path: Path, engine: Zero3Engine, optimizers: list[torch.optim.Optimizer], extra: dict[str, Any],
    model_key: str = "state_dict", optimizer_keys: Optional[list[str]] = None,
    keep: Optional[Callable[[str, Any], bool]] = None,
) -> None:
    """Write ``extra`` plus the model's full state dict under ``model_key`` and the ``optimizers``' full
    states to ``path`` as one ``torch.save`` file (a collective; rank 0 writes). The optimizers' states go
    in a list under ``optimizer_states`` (Lightning's layout), or each under its own name of
    ``optimizer_keys`` (Fabric's: ``{"model": ..., "optimizer": ...}``). ``keep(name, value)``: only the
    model's entries it accepts are written (Fabric's ``filter``; a parameter is passed as itself, which a
    released one allows only metadata of), and units with none of them are not gathered."""
    engine.settle()
    writing = engine.comm.rank == 0
    layouts = [full_state_layout(optimizer, engine) for optimizer in optimizers]
    later: dict[tuple, torch.Tensor] = {}  # (what, ...) -> placeholder, on the writing rank

    def hold(key: tuple, shape: torch.Size, dtype: torch.dtype) -> Optional[torch.Tensor]:
        if writing:
            later[key] = placeholder(TensorEntry([str(key)], list(shape), dtype))
        return later.get(key)

    checkpoint = dict(extra)
    own = engine.module.state_dict(keep_vars=True)
    names = None
    if keep is not None:  # rank 0's choice, by name, for every rank (a filter need not answer alike everywhere)
        names = [name for name, value in own.items() if keep(name, value)] if writing else None
        names = set(engine.comm.all_gather_objects(names)[0] if engine.comm.world_size > 1 else names)
    checkpoint[model_key] = _state_dict_skeleton(engine, own, hold, names)
    kept = {id(own[name]) for name in names} if names is not None else None
    states = [_optimizer_skeleton(engine, optimizer, layout, i, hold) for i, (optimizer, layout) in enumerate(zip(optimizers, layouts))]
    if optimizer_keys is not None:
        checkpoint.update(zip(optimizer_keys, states))
    elif optimizers:
        checkpoint["optimizer_states"] = states
    staging = staging_path(path)
    writer = None
    error: Optional[Exception] = None
    try:
        if writing:
            path.parent.mkdir(parents=True, exist_ok=True)
            writer = TorchFileWriter(staging, checkpoint, later.values())
        _stream_values(engine, optimizers, layouts, writer, later, kept)
        if writer is not None:
            writer.close()
            writer = None
            fsync_path(staging)
            if path.is_dir():
                from .atomic import remove_checkpoint

                remove_checkpoint(path)  # a sharded checkpoint of the same name is replaced by the file
            os.replace(staging, path)
    except Exception as failure:  # noqa: BLE001 - every rank learns of it below
        error = failure
        if writer is not None:
            writer.abort()
    finally:
        staging.unlink(missing_ok=True)

    def report() -> None:
        if error is not None:
            raise error

    agree_on_outcome(engine.comm, path, "writing it", report)  # [Note: a failed save fails everywhere]


def _state_dict_skeleton(engine: Zero3Engine, own: dict[str, Any], hold, names: Optional[set] = None) -> dict[str, Any]:
    """The model's entries (``names`` only, when given), its parameters as placeholders to fill."""
    state: dict[str, Any] = {}
    for name, value in own.items():
        if names is not None and name not in names:
            continue
        slot = engine.slots.get(id(value))
        if slot is not None:
            state[name] = hold(("param", id(slot.param)), slot.param.shape, engine.group_of(slot.shard_param)[0].dtype)
        else:
            state[name] = value.detach().cpu()
    return state


def _optimizer_skeleton(engine: Zero3Engine, optimizer: torch.optim.Optimizer, layout, number: int, hold) -> dict:
    state: dict[int, dict[str, Any]] = {index: dict(values) for index, values in layout.scalars.items()}
    for index, keys in layout.keys_of.items():
        slot = engine.group_of(layout.params[index])[1]
        for key in keys:
            state.setdefault(index, {})[key] = hold(("state", number, index, key), slot.param.shape, layout.dtypes[key])
    groups = engine.user_param_groups(optimizer, optimizer.state_dict()["param_groups"])
    return {"state": state, "param_groups": groups}


def _stream_values(engine: Zero3Engine, optimizers, layouts, writer: Optional[TorchFileWriter], later: dict,
                   kept: Optional[set] = None) -> None:  # fmt: skip
    """Gather unit after unit (weights, then each optimizer-state key) and let rank 0 write each tensor;
    with ``kept`` (ids of the parameters written), units holding none of them are skipped.

    On a failure of the writer, rank 0 stops writing but keeps taking part in the gathers, so the other
    ranks are never left waiting in a collective."""
    broken: list[BaseException] = []

    def fill(key: tuple, values: torch.Tensor) -> None:
        if writer is None or broken:
            return
        if key not in later:
            return  # left out by the filter
        try:
            writer.fill(later[key], values.cpu())
        except Exception as failure:  # noqa: BLE001 - re-raised once every gather is done
            broken.append(failure)

    for runtime in engine.runtimes:
        group = runtime.group
        if kept is None or any(id(slot.param) in kept for slot in group.slots):
            with group.gathered_master() as master:
                for slot in group.slots:
                    fill(("param", id(slot.param)), master[slot.offset : slot.offset + slot.numel])
        for number, (optimizer, layout) in enumerate(zip(optimizers, layouts)):
            indices = [i for i, p in enumerate(layout.params) if engine.group_of(p)[0] is group]
            for key in sorted({k for i in indices for k in layout.keys_of.get(i, ())}):
                with gathered_state(engine, optimizer, layout, group, indices, key) as full:
                    for index in indices:
                        if key in layout.keys_of.get(index, ()):
                            slot = engine.group_of(layout.params[index])[1]
                            fill(("state", number, index, key), full[slot.offset : slot.offset + slot.numel])
    if broken:
        raise broken[0]
