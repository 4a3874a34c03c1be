"""Checking a checkpoint's files against the checksums written with them, before anything is loaded.

``check_shared_files`` and ``check_and_hold``: the ranks of a load check every file of a sharded
checkpoint, each file by one rank, and all raise the same ``CheckpointError`` when one is bad (see
[Note: a load reads each file once]). ``verify_before_load``: one process checks every file (consolidation).
``check_full_file``: the ranks check a single-file checkpoint (``checkpoint_format="full"``, or DDP's)
against the CRC-32 its zip records carry.

``lightning-zero3 verify DIR`` (``main``) checks a sharded checkpoint (``zero3.json``) or a Hugging Face
export (``SHA256SUMS``) without loading it into a model: one line per bad file, exit status 1 if any.

[Note: a load reads each file once]
A load checks every file before any weight changes, and fails on every rank alike when one is bad. It
does so in two rounds, each ended by one exchange of what the ranks found (so no rank starts loading
while another has refused, and none waits for a rank that gave up):

1. ``check_shared_files``: rank 0 checks the small files every rank reads before the weights
   (``.metadata``, ``trainer_state.pt``, the JSON files).
2. ``check_and_hold``: the shard files ``__<r>_<k>.distcp``. Each is checked by the first rank that
   reads from it in this load (at the world size it was saved with, rank ``r`` reads exactly its own
   files), or by rank ``r mod world_size`` when none does. The checking rank reads the whole file in one
   sequential pass into memory of its own and hashes it as the pieces arrive (see [Note: checking a file
   in one sequential pass] in export/digests.py); once every rank has agreed that every file is good,
   DCP reads those bytes from memory instead of the disk, and each file's memory is returned as soon
   as DCP is done with it. So the check adds the hash to the load and no second read of the disk. The
   bytes a rank holds at once are its share of the checkpoint, up to ``HELD_SHARE`` of the memory
   available per rank of the node; files past that are hashed through the page cache and read again
   from it by DCP.
"""

from __future__ import annotations

import argparse
import re
import sys
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import Optional

import torch

from ..engine import Communicator
from ..engine.memory.buffers import host_buffer
from ..engine.memory.proc import MEMINFO, kib_field_bytes
from .atomic import MANIFEST, CheckpointError, read_manifest
from ..export.digests import ALIGN, PIECE, SHA256, bad_files, file_digest
from ..export.hf import SHA256SUMS, read_sha256sums

NO_CHECKSUMS = (
    "zero3: {path} was written without checksums (by a zero3 version before they were added), so its files "
    "are checked for their sizes only; a save with this version records them."
)
HELD_SHARE = 0.5  # of the memory available to each rank of a node: the most a load holds of its files
_SHARD_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


def _corrupt_line(path: Path, name: str, rank: Optional[int], algorithm: str, expected: str, actual: str) -> str:
    who = f"rank {rank} read it and found" if rank is not None else "found"
    return f"{path / name}: {who} the {algorithm} checksum {actual}, but it was written with {expected}"


def _check(path: Path, manifest: dict, names: list[str], rank: Optional[int],
           held: Optional[dict[str, torch.Tensor]] = None) -> tuple[list[str], list[str]]:  # fmt: skip
    """Check ``names``: a line per bad file (naming ``rank`` if given), and per file that could not be
    checked (unreadable, or no package for the algorithm). Files in ``held`` are read into its buffers."""
    algorithm, expected = manifest["checksums"]["algorithm"], manifest["checksums"]["files"]
    bad, errors = [], []
    for name in names:
        into = held.get(name) if held is not None else None
        try:
            actual = file_digest(path / name, algorithm, None if into is None else memoryview(into.numpy()))
        except (OSError, RuntimeError) as error:
            errors.append(f"rank {rank if rank is not None else 0}: {error}")
            if isinstance(error, RuntimeError):  # the same for every file: said once
                break
            continue
        if actual != expected[name]:
            bad.append(_corrupt_line(path, name, rank, algorithm, expected[name], actual))
    return bad, errors


def _agree(path: Path, comm: Optional[Communicator], found: tuple[list[str], list[str]]) -> None:
    """Every rank's findings, exchanged; the same ``CheckpointError`` on every rank if any file is bad."""
    everyone = comm.all_gather_objects(found) if comm is not None and comm.world_size > 1 else [found]
    lines = [line for bad, _ in everyone for line in bad] + [line for _, errors in everyone for line in errors]
    if lines:
        raise CheckpointError(
            f"zero3: checkpoint {path} is corrupt; nothing was loaded:\n  " + "\n  ".join(lines) + "\nIts bytes "
            "changed after the save (the disk, the filesystem or a copy). Load an earlier checkpoint, or copy "
            "the bad file(s) again from a good source."
        )


def _has_checksums(path: Path, manifest: dict, rank: int) -> bool:
    if manifest.get("checksums") is None:
        if rank == 0:
            warnings.warn(NO_CHECKSUMS.format(path=path), stacklevel=4)
        return False
    return True


def check_shared_files(path: Path, manifest: dict, comm: Communicator) -> bool:
    """Round 1 of [Note: a load reads each file once] (a collective): rank 0 checks every file but the
    shard files. False (and one warning) for a checkpoint written without checksums."""
    if not _has_checksums(path, manifest, comm.rank):
        return False
    shared = [name for name in manifest["checksums"]["files"] if not _SHARD_FILE.match(name)]
    _agree(path, comm, _check(path, manifest, shared, 0) if comm.rank == 0 else ([], []))
    return True


def check_and_hold(path: Path, manifest: dict, comm: Communicator, reads: set[str], hold: bool = True) -> dict[str, torch.Tensor]:
    """Round 2 of [Note: a load reads each file once] (a collective): the shard files checked, each by one
    rank; ``reads``: the files this rank's load reads. Returns the bytes of the files this rank checked
    and reads (name -> uint8 tensor), for ``load_pieces(..., held=...)``; none with ``hold=False`` (the
    files are then hashed through the page cache and DCP reads them again from there)."""
    expected = manifest["checksums"]["files"]
    everyone = comm.all_gather_objects(sorted(reads)) if comm.world_size > 1 else [sorted(reads)]
    mine: list[str] = []
    for name in expected:
        match = _SHARD_FILE.match(name)
        if match is None:
            continue
        readers = [rank for rank, names in enumerate(everyone) if name in names]
        if (readers[0] if readers else int(match.group(1)) % comm.world_size) == comm.rank:
            mine.append(name)
    held: dict[str, torch.Tensor] = {}
    try:
        room = _room(comm) if hold else 0
        for name in mine:
            size = manifest["files"][name]
            if name in reads and size <= room:
                held[name] = host_buffer(-(-size // ALIGN) * ALIGN, torch.uint8)
                room -= size
        found = _check(path, manifest, mine, comm.rank, held)
    except Exception as error:  # noqa: BLE001 - every rank learns of it in the exchange below
        found = ([], [f"rank {comm.rank}: {type(error).__name__}: {error}"])
    try:
        _agree(path, comm, found)
    except CheckpointError:
        held.clear()
        raise
    return {name: data[: manifest["files"][name]] for name, data in held.items()}


def _room(comm: Communicator) -> int:
    """The bytes of its files this rank may hold during a load: ``HELD_SHARE`` of the memory available
    on the node, divided among its ranks."""
    available = kib_field_bytes(MEMINFO, "MemAvailable") or 0
    return int(HELD_SHARE * available / max(1, min(comm.world_size, comm.topology.ranks_per_node)))


def check_full_file(path: Path, comm: Communicator) -> None:
    """Check a single-file checkpoint (``torch.save`` format: a zip of stored records) against the CRC-32
    of every record, which the zip carries from the write (a collective: record ``i`` is checked by rank
    ``i mod world_size``; all raise the same ``CheckpointError`` if one is bad). Neither ``torch.load`` nor
    its memory map checks these CRCs, so flipped bytes in a tensor would load as plausible numbers.
    A file of the legacy (non-zip) format carries none and is not checked."""
    found: tuple[list[str], list[str]] = ([], [])
    if path.is_file() and zipfile.is_zipfile(path):
        try:
            with zipfile.ZipFile(path) as archive, open(path, "rb") as stream:
                records = archive.infolist()
                for info in records[comm.rank :: comm.world_size]:
                    actual = _stored_crc(stream, info)
                    if actual != info.CRC:
                        found[0].append(f"{path} (its record {info.filename}): rank {comm.rank} read it and found "
                                        f"the crc32 checksum {actual:08x}, but it was written with {info.CRC:08x}")  # fmt: skip
        except (OSError, zipfile.BadZipFile, ValueError) as error:
            found[1].append(f"rank {comm.rank}: {path} could not be checked: {error}")
    _agree(path, comm, found)


def _stored_crc(stream, info: zipfile.ZipInfo) -> int:
    """The CRC-32 of the bytes of the zip record ``info`` as they are on the disk."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise ValueError(f"its record {info.filename} is compressed, which torch.save never writes")
    stream.seek(info.header_offset)
    header = stream.read(30)  # the local header: its name and extra field come before the bytes
    start = info.header_offset + 30 + int.from_bytes(header[26:28], "little") + int.from_bytes(header[28:30], "little")
    stream.seek(start)
    crc, left = 0, info.compress_size
    while left:
        piece = stream.read(min(PIECE, left))
        if not piece:
            raise ValueError(f"it ends inside its record {info.filename}")
        crc, left = zlib.crc32(piece, crc), left - len(piece)
    return crc


def verify_before_load(path: Path, manifest: dict) -> None:
    """Check every file of the sharded checkpoint ``path`` against ``manifest`` in this process alone
    (consolidation). Raises ``CheckpointError`` naming each bad file and both checksums; warns once for a
    checkpoint without checksums."""
    if _has_checksums(path, manifest, 0):
        _agree(path, None, _check(path, manifest, list(manifest["checksums"]["files"]), None))


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
        bad, errors = _check(directory, manifest, list(manifest["checksums"]["files"]), None)
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
