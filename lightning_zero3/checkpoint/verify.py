"""Checking a checkpoint's files against the checksums written with them, before anything is loaded.

``verify_before_load``: the ranks of a load (or the one process of a consolidation) check every file of a
sharded checkpoint, each file by one rank, and all raise the same ``CheckpointError`` when one is bad (see
[Note: each file checked by one rank, the outcome agreed by all] in export/digests.py).

``lightning-zero3 verify DIR`` (``main``) checks a sharded checkpoint (``zero3.json``) or a Hugging Face
export (``SHA256SUMS``) without loading it into a model: one line per bad file, exit status 1 if any.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Optional

from ..engine import Communicator
from .atomic import MANIFEST, CheckpointError, read_manifest
from ..export.digests import SHA256, bad_files, checking_rank
from ..export.hf import SHA256SUMS, read_sha256sums

NO_CHECKSUMS = (
    "zero3: {path} was written without checksums (by a zero3 version before they were added), so its files "
    "are checked for their sizes only; a save with this version records them."
)


def _corrupt_line(path: Path, name: str, rank: Optional[int], algorithm: str, expected: str, actual: str) -> str:
    who = f"rank {rank} read it and found" if rank is not None else "found"
    return f"{path / name}: {who} the {algorithm} checksum {actual}, but it was written with {expected}"


def _check_share(path: Path, manifest: dict, rank: int, world: int, named: bool) -> tuple[list[str], list[str]]:
    """The files of ``path`` that ``rank`` of ``world`` checks: a line per bad one (naming the rank if
    ``named``), and per file it could not check (unreadable, or no package for the algorithm)."""
    checksums = manifest["checksums"]
    algorithm, expected = checksums["algorithm"], checksums["files"]
    mine = [name for name in expected if checking_rank(name, world) == rank]
    try:
        bad = bad_files(path, mine, expected, algorithm)
    except (OSError, RuntimeError) as error:
        return [], [f"rank {rank}: {error}"]
    who = rank if named else None
    return [_corrupt_line(path, name, who, algorithm, exp, act) for name, exp, act in bad], []


def verify_before_load(path: Path, manifest: dict, comm: Optional[Communicator] = None) -> None:
    """Check the files of the sharded checkpoint ``path`` against ``manifest`` (a collective over ``comm``'s
    ranks; without one, this process checks every file). Raises ``CheckpointError`` on every rank, naming
    each bad file, the rank that read it and both checksums; warns once for a checkpoint without checksums."""
    rank, world = (comm.rank, comm.world_size) if comm is not None else (0, 1)
    if manifest.get("checksums") is None:
        if rank == 0:
            warnings.warn(NO_CHECKSUMS.format(path=path), stacklevel=3)
        return
    found = _check_share(path, manifest, rank, world, named=comm is not None)
    everyone = comm.all_gather_objects(found) if comm is not None and world > 1 else [found]
    lines = [line for bad, _ in everyone for line in bad] + [line for _, errors in everyone for line in errors]
    if lines:
        raise CheckpointError(
            f"zero3: checkpoint {path} is corrupt; nothing was loaded:\n  " + "\n  ".join(lines) + "\nIts bytes "
            "changed after the save (the disk, the filesystem or a copy). Load an earlier checkpoint, or copy "
            "the bad file(s) again from a good source."
        )


# -- lightning-zero3 verify ----------------------------------------------------------------------------


def problems(directory: Path) -> list[str]:
    """One line per bad file of the sharded checkpoint or Hugging Face export at ``directory`` (empty: all good)."""
    if (directory / MANIFEST).is_file() or not (directory / SHA256SUMS).is_file():
        try:
            manifest = read_manifest(directory)  # sizes, and the manifest's own checksum
        except CheckpointError as error:
            return [str(error)]
        if manifest.get("checksums") is None:
            warnings.warn(NO_CHECKSUMS.format(path=directory), stacklevel=2)
            return []
        bad, errors = _check_share(directory, manifest, 0, 1, named=False)
        return bad + errors
    lines = []
    for name, digest in read_sha256sums(directory).items():
        file = directory / name
        if not file.is_file():
            lines.append(f"{file}: missing (listed in {SHA256SUMS})")
            continue
        for _, expected, actual in bad_files(directory, [name], {name: digest}, SHA256):
            lines.append(_corrupt_line(directory, name, None, SHA256, expected, actual))
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lightning-zero3 verify",
        description="Check a zero3 sharded checkpoint or a Hugging Face export against the checksums written "
        "with it, without loading it into a model. Exit status 1 when a file is bad.",
    )
    parser.add_argument("directory", type=Path, help="a sharded checkpoint directory, or an export with SHA256SUMS")
    args = parser.parse_args(argv)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bad = problems(args.directory)
    for warning in caught:
        print(f"warning: {warning.message}", file=sys.stderr)
    for line in bad:
        print(f"BAD {line}")
    if bad:
        print(f"{args.directory}: {len(bad)} problem(s)")
        return 1
    print(f"{args.directory}: every file matches its checksum")
    return 0
