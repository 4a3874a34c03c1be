"""Single ``torch.save`` files: written atomically, read weights-only with errors that name the file."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any, Optional

import torch

from ..engine import Communicator
from ..export.writers import staging_path
from .atomic import CheckpointError, remove_checkpoint
from ..export.digests import DigestBook
from .verify import check_full_file


def write_torch_file(obj: Any, file: Path, book: Optional[DigestBook] = None) -> None:
    """``torch.save`` into ``file`` and flush it to disk; ``book`` records its checksum as it is written."""
    with open(file, "wb") as out:
        torch.save(obj, out if book is None else book.stream(out, file.name))
        out.flush()
        os.fsync(out.fileno())
    if book is not None:
        book.close(file.name)


def save_file_atomically(obj: Any, path: Path) -> None:
    """Write ``obj`` to ``path`` so that ``path`` always holds either the old or the whole new checkpoint."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_path(path)
    try:
        write_torch_file(obj, staging)
        if path.is_dir():
            remove_checkpoint(path)  # a sharded checkpoint of the same name is replaced by the file
        os.replace(staging, path)
    finally:
        if staging.exists():
            staging.unlink()


def torch_load_checked(file: Path, weights_only: Optional[bool] = True, mmap: bool = False) -> Any:
    """``torch.load`` (weights-only unless ``weights_only=False``), with errors that say what is wrong.
    ``mmap``: tensors are mapped from the file, read only where touched (see ``engine.memory.drop_pages``)."""
    if not file.is_file():
        raise CheckpointError(f"zero3: there is no checkpoint file at {file}.")
    try:
        return torch.load(file, map_location="cpu", weights_only=weights_only is not False, mmap=mmap)
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"zero3: {file} holds an object that weights-only loading refuses:\n{error}\nIf you trust this "
            "checkpoint, allow that class with torch.serialization.add_safe_globals([...]) before loading."
        ) from error
    except (RuntimeError, EOFError) as error:
        raise CheckpointError(f"zero3: {file} is not a readable checkpoint (truncated or corrupt?): {error}") from error


def load_checked_file(path: Path, comm: Communicator, weights_only: Optional[bool] = True) -> Any:
    """``torch_load_checked(path, mmap=True)`` on every rank of ``comm``, once the ranks agreed that every
    record of the file matches the CRC-32 written with it (``verify.check_full_file``)."""
    check_full_file(path, comm)
    return torch_load_checked(path, weights_only, mmap=True)


def load_file_checkpoint(path: Path, comm: Communicator, weights_only: Optional[bool] = True) -> dict[str, Any]:
    """A Lightning checkpoint file, checked, loaded memory-mapped (``load_checked_file``)."""
    checkpoint = load_checked_file(path, comm, weights_only)
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise CheckpointError(f"zero3: {path} is not a Lightning checkpoint (it has no 'state_dict').")
    return checkpoint
