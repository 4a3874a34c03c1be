"""Saving and loading a sharded checkpoint: one directory, each rank writing and reading its own part.

Layout of ``<name>/``::

    __<rank>_0.distcp   each rank's parameter and optimizer-state pieces (DCP, see dcp_io.py)
    .metadata           DCP's index of every piece (read without unpickling code)
    trainer_state.pt    everything else Lightning saves (loops, callbacks, schedulers, scaler, optimizer
                        hyper-parameters and step counts), written by rank 0, read with weights_only=True
    zero3.json          manifest: parameter names / shapes / dtypes / aliases and every file's size;
                        written last (see [Note: atomic checkpoint directories] in atomic.py)

Both functions are collectives over the engine's ranks. Neither gathers a parameter.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch

from ..engine import Communicator, Zero3Engine
from ..engine.memory import return_free_heap
from .atomic import MANIFEST, TRAINER_STATE, commit, partial_path, read_manifest, write_manifest
from .files import torch_load_checked, write_torch_file
from .hf import HF_CONFIG, find_hf_model, hf_configuration
from .dcp_io import FlatPiece, load_pieces, read_dcp_metadata, save_pieces
from .sharded import (
    MODEL_PREFIX,
    model_pieces,
    optimizer_pieces,
    CheckpointMismatchError,
    check_model_fits,
    merge_optimizer_rest,
    model_targets,
    optimizer_targets,
    split_optimizer_part,
)


def _describe_model(model_state: dict[str, Any]) -> tuple[dict, dict]:
    params: dict[str, dict] = {}
    buffers: dict[str, dict] = {}
    first: dict[int, str] = {}
    for name, value in model_state.items():
        if isinstance(value, FlatPiece):
            if id(value) in first:
                params[first[id(value)]]["aliases"].append(name)
                continue
            first[id(value)] = name
            params[name] = {"shape": list(value.shape), "dtype": str(value.tensor.dtype), "aliases": []}
        else:
            buffers[name] = {"shape": list(value.shape), "dtype": str(value.dtype)}
    return params, buffers


def save_sharded_checkpoint(
    path: Path, engine: Zero3Engine, optimizers: list[torch.optim.Optimizer], extra: dict[str, Any]
) -> None:
    """Write this rank's shards of the model and of ``optimizers``, and ``extra`` (rank 0's; anything
    ``torch.load(weights_only=True)`` reads back), to the checkpoint directory ``path`` (a collective).

    Under NVMe offload the pieces are read from the swap files one at a time while DCP writes them."""
    engine.settle()
    model_state = model_pieces(engine)
    optimizer_parts = [optimizer_pieces(engine, optimizer) for optimizer in optimizers]
    files = {}
    hf = find_hf_model(engine.module)
    if hf is not None:  # consolidation can then write a Hugging Face directory with nothing else at hand
        files[HF_CONFIG] = json.dumps({"prefix": hf[0], **hf_configuration(hf[1])})
    write_sharded_checkpoint(path, engine.comm, model_state, optimizer_parts, extra, files)
    return_free_heap()


def write_sharded_checkpoint(
    path: Path,
    comm: Communicator,
    model_state: dict[str, Any],
    optimizer_parts: list[dict[str, Any]],
    extra: dict[str, Any],
    files: Optional[dict[str, str]] = None,
) -> None:
    """The writing itself, from pieces made by ``model_pieces`` / ``optimizer_pieces`` (or by hand);
    ``files``: small text files rank 0 adds to the directory (name -> content)."""
    path = Path(comm.all_gather_objects(str(path))[0])
    params, buffers = _describe_model(model_state)
    state: dict[str, Any] = {}
    seen: set = set()
    for name, value in model_state.items():
        if id(value) in seen or (isinstance(value, FlatPiece) and value.tensor.numel() == 0):
            continue
        seen.add(id(value))
        state[MODEL_PREFIX + name] = value
    rests = []
    for index, part in enumerate(optimizer_parts):
        pieces, rest = split_optimizer_part(part, index)
        state.update(pieces)
        rests.append(rest)
    everyone = comm.all_gather_objects(rests)  # the optimizers' small part, merged over the ranks
    merged = [merge_optimizer_rest([rank_rests[i] for rank_rests in everyone]) for i in range(len(rests))]

    partial = Path(comm.all_gather_objects(str(partial_path(path)) if comm.rank == 0 else None)[0])
    if comm.rank == 0:
        partial.mkdir(parents=True)
    comm.all_gather_objects(None)  # the directory exists for everyone
    save_pieces(state, partial, comm.group)
    if comm.rank == 0:
        write_torch_file({**extra, "optimizer_states": merged}, partial / TRAINER_STATE)
        for name, content in (files or {}).items():
            (partial / name).write_text(content)
        write_manifest(partial, {"world_size": comm.world_size, "params": params, "buffers": buffers})
        commit(partial, path)
    comm.all_gather_objects(None)  # nobody returns before the checkpoint has its name


def load_trainer_state(path: Path, weights_only: Optional[bool] = True) -> dict[str, Any]:
    return torch_load_checked(path / TRAINER_STATE, weights_only)


def load_sharded_checkpoint(
    path: Path,
    engine: Zero3Engine,
    optimizers: list[torch.optim.Optimizer],
    strict: bool = True,
    weights_only: Optional[bool] = True,
) -> dict[str, Any]:
    """Fill the engine's shards (and, given ``optimizers``, their state) from ``path``; return ``extra``.

    The checkpoint may have been written by any number of ranks (see [Note: flat pieces in DCP])."""
    manifest = read_manifest(path)
    check_model_fits(engine, manifest["params"], manifest["buffers"], strict)
    extra = load_trainer_state(path, weights_only)
    saved_names = manifest["params"].keys() | manifest["buffers"].keys()
    engine.settle()
    _load_states(path, engine, optimizers, extra, saved_names)
    engine.after_states_loaded()
    extra.pop("optimizer_states", None)
    return extra


def _load_states(
    path: Path, engine: Zero3Engine, optimizers: list[torch.optim.Optimizer], extra: dict, saved_names: set
) -> None:
    targets = model_targets(engine, saved_names)
    optimizer_states = []
    if optimizers:
        if "optimizer_states" not in extra:
            raise CheckpointMismatchError(
                f"zero3: {path} holds no optimizer state (was it saved with `save_weights_only=True`?), so "
                "training cannot resume from it; resume from a full training checkpoint instead."
            )
        saved = extra["optimizer_states"]
        if len(saved) != len(optimizers):
            raise CheckpointMismatchError(
                f"zero3: the checkpoint holds {len(saved)} optimizer state(s) but {len(optimizers)} optimizer(s) "
                "are to be loaded; resume with the optimizers the checkpoint was written with."
            )
        dtypes = {key: md.properties.dtype for key, md in read_dcp_metadata(path).state_dict_metadata.items()
                  if hasattr(md, "properties")}  # fmt: skip
        for index, (optimizer, rest) in enumerate(zip(optimizers, saved)):
            pieces, optimizer_state = optimizer_targets(engine, optimizer, index, rest, dtypes)
            targets.update(pieces)
            optimizer_states.append(optimizer_state)
    with torch.no_grad():
        load_pieces(targets, path, engine.comm.group)
    for optimizer, optimizer_state in zip(optimizers, optimizer_states):
        optimizer.load_state_dict(optimizer_state)
        engine.keep_host_kernel(optimizer)
    engine.note_optimizer_state()

