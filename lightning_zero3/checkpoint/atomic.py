"""Checkpoint directories that exist whole or not at all, and the checks that say which.

[Note: atomic checkpoint directories]
A sharded checkpoint is a directory that every rank writes into. It is first written under a hidden
sibling name, ``.<name>.partial-<id>``; only when every rank has finished does rank 0 write the
manifest ``zero3.json`` (sizes of every file, written last, fsynced) and rename the directory to its
real name. A process killed mid-save therefore leaves the previous checkpoint untouched and a
``.partial-`` directory without a manifest, which nothing mistakes for a checkpoint; the next save of
the same name removes it. Overwriting a name (``last.ckpt``) moves the old directory aside first
(``.<name>.old-<id>``), renames the new one in, then deletes the old: if the process dies between
the two renames, loading the name says where the previous checkpoint is.

On load, ``read_manifest`` refuses a directory without a manifest (interrupted save), a manifest whose
own checksum does not match, and any file whose size differs from the manifest's (truncated or
replaced), naming the file; the checksums of the files themselves are checked by the ranks before any
of them loads a weight (``verify.py``).

A save that fails removes its ``.partial-`` directory (``remove_partial``) and says so in its error.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any, Optional

from ..export.digests import DigestBook, body_digest

from ..export.writers import stale_staging_paths

MANIFEST = "zero3.json"
TRAINER_STATE = "trainer_state.pt"
FORMAT = "lightning_zero3.sharded"
VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, truncated or unreadable; the message names the problem."""


def fsync_path(path: Path) -> None:
    """Flush a file, or a directory's entries, to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(directory: Path, manifest: dict[str, Any], digests: Optional[DigestBook] = None) -> None:
    """Record the size of every file in ``directory`` (and, given ``digests``, its checksum, taken as it was
    written) and write the manifest last (the completion mark)."""
    files = {
        str(p.relative_to(directory)): p.stat().st_size for p in sorted(directory.rglob("*")) if p.is_file()
    }
    body = {"format": FORMAT, "version": VERSION, **manifest, "files": files}
    if digests is not None:
        unrecorded = sorted(files.keys() - digests.digests.keys())
        if unrecorded:  # every file of a checkpoint must be hashed as it is written: see digests.py
            raise RuntimeError(f"zero3: no checksum was recorded while writing {unrecorded} into {directory}.")
        body["checksums"] = {"algorithm": digests.algorithm, "files": {n: digests.digests[n] for n in files}}
        body["checksums"]["manifest"] = body_digest(body, digests.algorithm)
    staging = directory / f".{MANIFEST}.tmp"
    with open(staging, "w") as out:
        json.dump(body, out, indent=1)
        out.flush()
        os.fsync(out.fileno())
    os.replace(staging, directory / MANIFEST)
    fsync_path(directory)


def commit(partial: Path, final: Path) -> None:
    """Give the finished ``partial`` directory its real name, replacing an older checkpoint of that name."""
    aside = None
    if final.is_dir():
        aside = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:12]}"
        os.rename(final, aside)
    elif final.exists():
        final.unlink()  # a single-file checkpoint of the same name is replaced by the directory
    try:
        os.rename(partial, final)
    except OSError:
        if aside is not None:
            os.rename(aside, final)  # the previous checkpoint keeps its name
        raise
    fsync_path(final.parent)
    if aside is not None:
        shutil.rmtree(aside)
    for stale in stale_staging_paths(final):
        shutil.rmtree(stale, ignore_errors=True)  # left by a save that was killed


def is_sharded_checkpoint(path: Path) -> bool:
    return path.is_dir()


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of the complete checkpoint at ``path``, or a ``CheckpointError`` saying what is wrong."""
    if not path.exists():
        leftovers = sorted(path.parent.glob(f".{path.name}.old-*")) if path.parent.is_dir() else []
        hint = f" A previous checkpoint of that name was moved aside to {leftovers[-1]}." if leftovers else ""
        raise CheckpointError(f"zero3: there is no checkpoint at {path}.{hint}")
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(
            f"zero3: {path} is an incomplete checkpoint: it has no {MANIFEST}, which is written last, so the save "
            "was interrupted (or the directory is not a zero3 checkpoint). Load an earlier checkpoint."
        )
    try:
        manifest = json.loads(manifest_path.read_text())
    except (ValueError, OSError) as error:
        raise CheckpointError(f"zero3: the manifest {manifest_path} is unreadable ({error}).") from error
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(
            f"zero3: {path} is not a zero3 sharded checkpoint of version {VERSION} "
            f"(format {manifest.get('format')!r}, version {manifest.get('version')!r})."
        )
    _check_manifest_digest(manifest_path, manifest)
    for name, size in manifest["files"].items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"zero3: checkpoint {path} is missing its file {name}; it was damaged after saving.")
        actual = file.stat().st_size
        if actual != size:
            raise CheckpointError(
                f"zero3: checkpoint file {file} has {actual} bytes but was written with {size}: it is truncated "
                "or was replaced. Load an earlier checkpoint."
            )
    return manifest


def _check_manifest_digest(manifest_path: Path, manifest: dict[str, Any]) -> None:
    checksums = manifest.get("checksums")
    if checksums is None:
        return  # written before checksums: see ``verify.py``
    stored = checksums.get("manifest")
    body = {**manifest, "checksums": {k: v for k, v in checksums.items() if k != "manifest"}}
    try:
        actual = body_digest(body, checksums["algorithm"])
    except RuntimeError as error:
        raise CheckpointError(str(error)) from None
    if actual != stored:
        raise CheckpointError(
            f"zero3: the manifest {manifest_path} is corrupt: its content has the {checksums['algorithm']} checksum "
            f"{actual} but was written with {stored}. Load an earlier checkpoint."
        )


def remove_partial(partial: Path) -> str:
    """Remove the directory of a failed save; a phrase that says what became of it (for the error)."""
    if not partial.exists():
        return f"nothing was left behind ({partial.name} was never created)"
    shutil.rmtree(partial, ignore_errors=True)
    if partial.exists():
        warnings.warn(f"zero3: could not remove {partial} after a failed save; delete it by hand.", stacklevel=2)
        return f"its partial directory {partial} could not be removed (delete it by hand)"
    return f"its partial directory {partial} was removed"


def remove_checkpoint(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
