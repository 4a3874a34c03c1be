"""What a rank contributes to a sharded checkpoint, and how it takes its part back.

The model's part is a dict under the module's own ``state_dict`` names: every sharded parameter is a
``FlatPiece`` (this rank's element range of the flattened parameter, a view of its shard: nothing is
copied or gathered), every buffer its tensor. A tied parameter appears under each of its names as the
*same* piece object; it is written once and its other names are recorded as aliases.

The optimizer's part follows ``optimizer.state_dict()``, keyed by parameter name instead of index:
per-element state (Adam's moments, SGD's momentum) as ``FlatPiece``s over the same element ranges as
the parameter, everything else (``step``, hyper-parameters) as it is. Per-element state goes into DCP;
the rest is small, identical on every rank, and travels in the trainer-state file.

Under NVMe offload a group whose states are on disk contributes pieces backed by its swap files (see
[Note: checkpoints straight from the swap files] in dcp_io.py): the caller first lets every write land
(``engine.offload.settle()``), and nothing is read into memory beyond one piece at a time.
"""

from __future__ import annotations

from typing import Any

import torch

from ..engine import Zero3Engine
from ..engine.grads.optim import optimizer_params
from ..engine.layout.slots import ParamSlot
from ..engine.offload.store import MASTER, state_kind
from ..engine.shard.flat_group import FlatGroup
from .dcp_io import FileRange, FlatPiece

MODEL_PREFIX = "model."


def optimizer_prefix(index: int) -> str:
    return f"optimizer.{index}."


class CheckpointMismatchError(ValueError):
    """A checkpoint was written for another model or optimizer; the message lists what differs."""


def _on_disk(group: FlatGroup) -> bool:
    return group.store is not None and group.store.offload.nvme and not group.store.resident


def _piece(group: FlatGroup, slot: ParamSlot, tensor: torch.Tensor) -> FlatPiece:
    start = slot.piece_start(group.comm.rank, group.shard_numel)
    return FlatPiece(tensor, start, slot.numel, tuple(slot.param.shape), bucket=group.name)


def _file_piece(group: FlatGroup, slot: ParamSlot, kind: str) -> FlatPiece:
    """This rank's piece of ``slot`` in the swap file of ``kind`` (the master, or an optimizer state)."""
    file, offset, dtype = group.store.file_range(kind, slot.lo, slot.hi)
    piece = _piece(group, slot, torch.empty(slot.hi - slot.lo, dtype=dtype, device="meta"))
    piece.source = FileRange(file, offset, group.ledger)
    return piece


def _owner(engine: Zero3Engine) -> dict[int, tuple[FlatGroup, ParamSlot]]:
    """Group and slot of every sharded parameter, by id of the user's parameter."""
    return {id(slot.param): engine.group_of(slot.shard_param) for slot in engine.slots.values()}


def model_pieces(engine: Zero3Engine) -> dict[str, Any]:
    """This rank's part of ``module.state_dict()``: a ``FlatPiece`` per parameter, buffers as they are."""
    owner = _owner(engine)
    pieces: dict[int, FlatPiece] = {}
    state: dict[str, Any] = {}
    for name, value in engine.module.state_dict(keep_vars=True).items():
        if id(value) in owner:
            group, slot = owner[id(value)]
            if id(value) not in pieces:  # the shard parameter: under offload, a view of the tier's master
                if _on_disk(group):
                    pieces[id(value)] = _file_piece(group, slot, MASTER)
                else:
                    pieces[id(value)] = _piece(group, slot, slot.shard_param.detach().reshape(-1))
            state[name] = pieces[id(value)]
        else:
            state[name] = value.detach()
    return state


def param_names(engine: Zero3Engine) -> dict[int, str]:
    """The first ``state_dict`` name of every sharded parameter, by id of its *shard* parameter."""
    first: dict[int, str] = {}
    for name, value in engine.module.state_dict(keep_vars=True).items():
        first.setdefault(id(value), name)
    return {id(slot.shard_param): first[id(slot.param)] for slot in engine.slots.values()}


def optimizer_pieces(engine: Zero3Engine, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's part of ``optimizer.state_dict()``, keyed by parameter name (see the module note)."""
    names = param_names(engine)
    params = optimizer_params(optimizer)
    local = optimizer.state_dict()
    state: dict[str, dict[str, Any]] = {}
    for index, values in local["state"].items():
        shard_param = params[index]
        group, slot = engine.group_of(shard_param)
        entry = {}
        for key, value in values.items():
            if _on_disk(group) and key in group.store.state_dtypes:  # a placeholder: the values are on disk
                entry[key] = _file_piece(group, slot, state_kind(key))
            elif _per_element(value, shard_param):
                entry[key] = _piece(group, slot, value.reshape(-1))
            else:
                entry[key] = value
        state[names[id(shard_param)]] = entry
    groups = [{**g, "params": [names[id(params[i])] for i in g["params"]]} for g in local["param_groups"]]
    return {"state": state, "param_groups": engine.user_param_groups(optimizer, groups)}


def _per_element(value: Any, shard_param: torch.Tensor) -> bool:
    return torch.is_tensor(value) and value.dim() > 0 and value.shape == shard_param.shape


# -- loading ------------------------------------------------------------------------------------------


def check_model_fits(engine: Zero3Engine, params: dict[str, dict], buffers: dict[str, dict], strict: bool) -> None:
    """Compare the checkpoint's parameter and buffer names and shapes with the model's; list what differs."""
    own = model_pieces(engine)
    saved = {**params, **{a: p for p in params.values() for a in p["aliases"]}, **buffers}
    missing = sorted(own.keys() - saved.keys())
    unexpected = sorted(saved.keys() - own.keys())
    shapes = []
    for name in sorted(own.keys() & saved.keys()):
        value = own[name]
        shape = list(value.shape)
        if shape != list(saved[name]["shape"]):
            shapes.append(f"{name}: checkpoint {saved[name]['shape']}, model {shape}")
    if shapes or (strict and (missing or unexpected)):
        raise CheckpointMismatchError(
            "zero3: the checkpoint does not fit this model (it was written for another model or configuration):"
            + (f"\n  shape differs: {'; '.join(shapes)}" if shapes else "")
            + (f"\n  missing in the checkpoint: {missing}" if missing else "")
            + (f"\n  not in the model: {unexpected}" if unexpected else "")
            + "\nLoad it into the model it was saved from, or pass a checkpoint of this model."
        )


def model_targets(engine: Zero3Engine, saved_names: set) -> dict[str, Any]:
    """Where the checkpoint's model tensors land: this rank's shard pieces and the buffers themselves."""
    state = model_pieces(engine)
    seen: set = set()
    targets = {}
    for name, value in state.items():
        if name not in saved_names or id(value) in seen:
            continue  # aliases load through their first name
        seen.add(id(value))
        if isinstance(value, FlatPiece) and value.tensor.numel() == 0:
            continue
        targets[MODEL_PREFIX + name] = value
    return targets


def optimizer_targets(
    engine: Zero3Engine, optimizer: torch.optim.Optimizer, index: int, saved: dict, dtypes: dict[str, torch.dtype]
) -> tuple[dict[str, FlatPiece], dict]:
    """Empty per-element state for this rank's pieces (for DCP to fill) and the optimizer state dict
    that holds them once filled. ``saved`` is the checkpoint's non-tensor part of this optimizer."""
    names = param_names(engine)
    params = optimizer_params(optimizer)
    position = {names[id(p)]: i for i, p in enumerate(params)}
    saved_groups = saved["param_groups"]
    own_groups = optimizer.state_dict()["param_groups"]
    saved_params = [g["params"] for g in saved_groups]
    own_params = [[names[id(params[i])] for i in g["params"]] for g in own_groups]
    if saved_params != own_params:
        raise CheckpointMismatchError(
            f"zero3: optimizer {index} in the checkpoint steps other parameters than `configure_optimizers` "
            f"returns now (groups {[len(p) for p in saved_params]} vs {[len(p) for p in own_params]} parameters); "
            "resume with the optimizer the checkpoint was written with."
        )
    targets: dict[str, FlatPiece] = {}
    state: dict[int, dict[str, Any]] = {}
    prefix = optimizer_prefix(index)
    for name, entry in saved["state"].items():
        shard_param = params[position[name]]
        group, slot = engine.group_of(shard_param)
        values = {}
        for key, value in entry.items():
            if key in saved["per_element"].get(name, ()):
                dtype = dtypes[f"{prefix}{name}.{key}"]
                if _on_disk(group):  # DCP writes the values straight into the state's swap file
                    group.store.ensure_state(key, dtype)
                    if slot.hi > slot.lo:
                        targets[f"{prefix}{name}.{key}"] = _file_piece(group, slot, state_kind(key))
                    values[key] = torch.empty(0, dtype=dtype)  # the resident-less placeholder
                    continue
                tensor = torch.zeros(shard_param.numel(), dtype=dtype, device=shard_param.device)
                if tensor.numel():
                    targets[f"{prefix}{name}.{key}"] = _piece(group, slot, tensor)
                values[key] = tensor.view(shard_param.shape)
            else:
                values[key] = value.clone() if torch.is_tensor(value) else value
        state[position[name]] = values
    groups = [{**g, "params": own["params"]} for g, own in zip(saved_groups, own_groups)]
    return targets, {"state": state, "param_groups": groups}


def split_optimizer_part(part: dict[str, Any], index: int) -> tuple[dict[str, FlatPiece], dict]:
    """An ``optimizer_pieces`` dict -> (its FlatPieces under DCP keys, the rest with per-element key names)."""
    prefix = optimizer_prefix(index)
    pieces: dict[str, FlatPiece] = {}
    rest_state: dict[str, dict] = {}
    per_element: dict[str, list[str]] = {}
    for name, entry in part["state"].items():
        rest_state[name] = {}
        for key, value in entry.items():
            if isinstance(value, FlatPiece):
                per_element.setdefault(name, []).append(key)
                rest_state[name][key] = None  # filled on load
                if value.tensor.numel():
                    pieces[f"{prefix}{name}.{key}"] = value
            else:
                rest_state[name][key] = value
    return pieces, {"state": rest_state, "param_groups": part["param_groups"], "per_element": per_element}


def merge_optimizer_rest(parts: list[dict]) -> dict:
    """The non-tensor part of one optimizer as the ranks saw it, merged (a rank may lack some parameters)."""
    merged: dict[str, Any] = {"state": {}, "param_groups": parts[0]["param_groups"], "per_element": {}}
    for part in parts:
        for name, entry in part["state"].items():
            merged["state"].setdefault(name, {}).update(entry)
        for name, keys in part["per_element"].items():
            merged["per_element"][name] = sorted(set(merged["per_element"].get(name, [])) | set(keys))
    return merged

