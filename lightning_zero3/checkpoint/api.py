"""Saving and loading a sharded checkpoint: one directory, each rank writing and reading its own part.

Layout of ``<name>/``::

    __<rank>_0.distcp   each rank's parameter and optimizer-state pieces (DCP, see dcp_io.py)
    .metadata           DCP's index of every piece (read without unpickling code)
    trainer_state.pt    everything else Lightning saves (loops, callbacks, schedulers, scaler, optimizer
                        hyper-parameters and step counts), written by rank 0, read with weights_only=True
    zero3.json          manifest: parameter names / shapes / dtypes / aliases and every file's size and
                        checksum (digests.py); written last (see [Note: atomic checkpoint directories] in
                        atomic.py)

Both functions are collectives over the engine's ranks. Neither gathers a parameter.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch.distributed.checkpoint.api import CheckpointException

from ..engine import Communicator, Zero3Engine
from ..engine.memory.buffers import return_free_heap
from ..export.digests import DigestBook, writing_algorithm
from ..export.writers import failures_everywhere, staging_path
from .atomic import TRAINER_STATE, CheckpointError, commit, read_manifest, remove_partial, write_manifest
from .dcp_io import FlatPiece, NonFiniteStateError, files_read, load_pieces, read_dcp_metadata, save_pieces
from .files import torch_load_checked, write_torch_file
from ..export.hf import HF_CONFIG, find_hf_model, hf_configuration
from .sharded import (
    MODEL_PREFIX,
    CheckpointMismatchError,
    check_model_fits,
    merge_optimizer_rest,
    model_pieces,
    model_targets,
    optimizer_pieces,
    optimizer_targets,
    split_optimizer_part,
)
from .verify import check_shared_files, checking_shard_files


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
    path: Path, engine: Zero3Engine, optimizers: list[torch.optim.Optimizer], extra: dict[str, Any],
    checksums: bool = True,
) -> None:
    """Write this rank's shards of the model and of ``optimizers``, and ``extra`` (rank 0's; anything
    ``torch.load(weights_only=True)`` reads back), to the checkpoint directory ``path`` (a collective).

    Under NVMe offload the pieces are read from the swap files one at a time while DCP writes them. A
    state holding NaN or inf is refused unless ``Zero3Config.save_non_finite``; ``checksums=False`` writes
    no checksums (for measuring what they cost)."""
    engine.settle()
    model_state = model_pieces(engine)
    optimizer_parts = [optimizer_pieces(engine, optimizer) for optimizer in optimizers]
    files = {}
    hf = find_hf_model(engine.module)
    if hf is not None:  # consolidation can then write a Hugging Face directory with nothing else at hand
        files[HF_CONFIG] = json.dumps({"prefix": hf[0], **hf_configuration(hf[1])})
    if engine.plan_estimate is not None:  # the automatic offload plan this run took, and why
        files[OFFLOAD_PLAN] = json.dumps(offload_plan(engine), indent=1)
    if engine.dynamic_plan is not None:  # the plan level in force: a resume starts from it
        extra = {**extra, DYNAMIC_PLAN: engine.dynamic_plan.state_dict()}
    write_sharded_checkpoint(path, engine.comm, model_state, optimizer_parts, extra, files, checksums=checksums,
                             step=extra.get("global_step"), allow_non_finite=engine.config.save_non_finite)  # fmt: skip
    return_free_heap()


OFFLOAD_PLAN = "offload_plan.json"  # inside a sharded checkpoint of a run with offload_*="auto"
DYNAMIC_PLAN = "zero3_dynamic_plan"  # in the trainer state of such a checkpoint (see engine/plan/dynamic.py)


def offload_plan(engine: Zero3Engine) -> dict[str, Any]:
    """The automatic offload plan of ``engine``: what was asked, what was taken and sized, the figures."""
    cfg, estimate = engine.config, engine.plan_estimate
    return {
        "plan": estimate.plan, "asked": engine.auto_settings, "memory_budget_bytes": engine.plan_budget,
        "taken": {name: getattr(cfg, name) for name in ("offload_optimizer", "offload_params", "offload_buffer_count",
                                                          "prefetch_bucket_size")},
        "estimated_bytes_per_rank": estimate.device_bytes_per_rank, "why": engine.plan_choice,
        "in_force": engine.dynamic_plan.state_dict() if engine.dynamic_plan is not None else None,
    }  # fmt: skip


def write_sharded_checkpoint(
    path: Path,
    comm: Communicator,
    model_state: dict[str, Any],
    optimizer_parts: list[dict[str, Any]],
    extra: dict[str, Any],
    files: Optional[dict[str, str]] = None,
    checksums: bool = True,
    step: Optional[int] = None,
    allow_non_finite: bool = False,
) -> None:
    """The writing itself, from pieces made by ``model_pieces`` / ``optimizer_pieces`` (or by hand);
    ``files``: small text files rank 0 adds to the directory (name -> content). Every file's checksum goes
    into the manifest (unless ``checksums=False``; see digests.py); a tensor holding NaN or inf fails the
    save with ``NonFiniteCheckpointError`` naming it and ``step``, unless ``allow_non_finite``. A failed
    save removes its partial directory, and its error says so."""
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

    partial = Path(comm.all_gather_objects(str(staging_path(path)) if comm.rank == 0 else None)[0])
    book = DigestBook(writing_algorithm()) if checksums else None
    # the directory exists for everyone, or everyone raises
    agree_on_outcome(comm, path, "creating its directory", (lambda: partial.mkdir(parents=True)) if comm.rank == 0 else None,
                     partial)  # fmt: skip
    try:
        save_pieces(state, partial, comm.group, book, step, allow_non_finite)
    except CheckpointException as error:  # DCP raises it on every rank, with every rank's failure
        removed = remove_everywhere(comm, partial)
        refused = {rank: e for rank, (e, _) in error.failures.items() if isinstance(e, NonFiniteStateError)}
        if refused:
            first = min(refused)
            raise NonFiniteCheckpointError(
                f"{refused[first]} (found by rank {first}). No checkpoint was written under {path}: {removed}."
            ) from None
        causes = {rank: f"{type(e).__name__}: {e}" for rank, (e, _) in error.failures.items()}
        raise CheckpointError(_failure_message(path, "writing the shards", causes, removed)) from None
    if book is not None:  # every rank's checksums, for rank 0's manifest
        for digests in comm.all_gather_objects(book.digests):
            book.digests.update(digests)

    def finish() -> None:
        write_torch_file({**extra, "optimizer_states": merged}, partial / TRAINER_STATE, book)
        for name, content in (files or {}).items():
            (partial / name).write_text(content)
            if book is not None:
                book.add(name, content)
        write_manifest(partial, {"world_size": comm.world_size, "params": params, "buffers": buffers}, book)
        commit(partial, path)

    # nobody returns before the checkpoint has its name, and rank 0's outcome reaches everyone
    agree_on_outcome(comm, path, "committing it", finish if comm.rank == 0 else None, partial)


class NonFiniteCheckpointError(CheckpointError):
    """A save was refused because the model or optimizer state holds NaN or inf; the message names the
    first such tensor and the step. ``Zero3Config(save_non_finite=True)`` keeps such checkpoints."""


def agree_on_outcome(
    comm: Communicator, path: Path, what: str, action: Optional[Callable[[], None]], partial: Optional[Path] = None
) -> None:
    """Run ``action`` (on the ranks that pass one), then tell every rank how it went: if it failed
    anywhere, the save's ``partial`` directory is removed and every rank raises the same
    ``CheckpointError`` (a collective).

    [Note: a failed save fails everywhere]
    Parts of a save run on rank 0 alone (creating the directory, the manifest, the rename). Were rank 0 to
    raise there, the others would wait in the next collective until the timeout. So the outcome, an error
    message or None, travels in the collective every rank runs anyway at that point."""
    error = None
    if action is not None:
        try:
            action()
        except Exception as failure:  # noqa: BLE001 - reported on every rank below
            error = f"{type(failure).__name__}: {failure}"
    causes = failures_everywhere(error, comm.all_gather_objects)
    if causes:
        removed = remove_everywhere(comm, partial) if partial is not None else None
        raise CheckpointError(_failure_message(path, what, causes, removed))


def remove_everywhere(comm: Communicator, partial: Path) -> str:
    """Remove a failed save's ``partial`` directory (a collective, once every rank stopped writing into it):
    rank 0 first, then any rank that still sees it (a filesystem not shared by every node). Returns what
    became of it, in rank 0's words."""
    said = comm.all_gather_objects(remove_partial(partial) if comm.rank == 0 else None)[0]
    if comm.rank != 0 and partial.exists():
        remove_partial(partial)
    return said


def _failure_message(path: Path, what: str, causes: dict[int, str], removed: Optional[str] = None) -> str:
    listed = "; ".join(f"rank {rank}: {cause}" for rank, cause in sorted(causes.items()))
    return (
        f"zero3: saving the checkpoint {path} failed while {what} ({listed}). No checkpoint was written under "
        f"that name{f' ({removed})' if removed else ''}; earlier checkpoints are untouched and load as before. "
        "Fix the cause (disk space, permissions) and save again."
    )


def load_trainer_state(path: Path, weights_only: Optional[bool] = True) -> dict[str, Any]:
    return torch_load_checked(path / TRAINER_STATE, weights_only)


def load_sharded_checkpoint(
    path: Path,
    engine: Zero3Engine,
    optimizers: list[torch.optim.Optimizer],
    strict: bool = True,
    weights_only: Optional[bool] = True,
    verify: bool = True,
) -> dict[str, Any]:
    """Fill the engine's shards (and, given ``optimizers``, their state) from ``path``; return ``extra``.

    The checkpoint may have been written by any number of ranks (see [Note: flat pieces in DCP]). Its
    files are checked against their checksums before any weight changes, each read from the disk once
    (see [Note: checking beside the load] in verify.py; not with ``verify=False``, for measuring what
    that costs)."""
    manifest = read_manifest(path)
    check_model_fits(engine, manifest["params"], manifest["buffers"], strict)
    checked = verify and check_shared_files(path, manifest, engine.comm)
    extra = load_trainer_state(path, weights_only)
    saved_names = manifest["params"].keys() | manifest["buffers"].keys()
    engine.settle()
    _load_states(path, engine, optimizers, extra, saved_names, manifest if checked else None)
    engine.after_states_loaded()
    extra.pop("optimizer_states", None)
    in_force = extra.pop(DYNAMIC_PLAN, None)
    if in_force is not None and engine.dynamic_plan is not None and optimizers:  # resuming training
        engine.dynamic_plan.load_state_dict(in_force)
    return extra


def _load_states(
    path: Path, engine: Zero3Engine, optimizers: list[torch.optim.Optimizer], extra: dict, saved_names: set,
    checked: Optional[dict] = None,
) -> None:
    """Fill the shards and the optimizers' state; with ``checked`` (the manifest), the shard files are
    checked while the optimizer states that land in tensors of their own are made and read, and the rest
    is read once every rank agreed that all files are good (see [Note: checking beside the load] in
    verify.py)."""
    targets = model_targets(engine, saved_names)
    if not checked:
        pieces, optimizer_states = _optimizer_targets(path, engine, optimizers, extra)
        with torch.no_grad():
            load_pieces({**targets, **pieces}, path, engine.comm.group)
    else:
        # the files the weights come from are the ones this rank reads: their optimizer states lie beside them
        with checking_shard_files(path, checked, engine.comm, files_read(targets, path)):
            pieces, optimizer_states = _optimizer_targets(path, engine, optimizers, extra)
            fresh = {key: piece for key, piece in pieces.items() if piece.source is None}  # new tensors, unused yet
            with torch.no_grad():
                load_pieces(fresh, path, engine.comm.group)
        with torch.no_grad():
            load_pieces({**targets, **{k: p for k, p in pieces.items() if k not in fresh}}, path, engine.comm.group)
    for optimizer, optimizer_state in zip(optimizers, optimizer_states):
        optimizer.load_state_dict(optimizer_state)
        engine.keep_host_kernel(optimizer)
    engine.note_optimizer_state()


def _optimizer_targets(
    path: Path, engine: Zero3Engine, optimizers: list[torch.optim.Optimizer], extra: dict
) -> tuple[dict[str, FlatPiece], list[dict]]:
    """Where the checkpoint's state of each of ``optimizers`` lands (``optimizer_targets``), all together,
    and the state dicts that hold it."""
    if not optimizers:
        return {}, []
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
    pieces: dict[str, FlatPiece] = {}
    states = []
    for index, (optimizer, rest) in enumerate(zip(optimizers, saved)):
        own, state = optimizer_targets(engine, optimizer, index, rest, dtypes)
        pieces.update(own)
        states.append(state)
    return pieces, states

