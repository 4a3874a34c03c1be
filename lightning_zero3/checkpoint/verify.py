"""Checking a checkpoint's files against the checksums written with them, before anything is loaded.

``check_shared_files`` and ``checking_shard_files``: the ranks of a load check every file of a sharded
checkpoint, each file by one rank, and all raise the same ``CheckpointError`` when one is bad (see
[Note: checking beside the load]). ``BackgroundCheck``: one process checks every file while it
consolidates. ``check_full_file``: the ranks check a single-file checkpoint (``checkpoint_format="full"``,
or DDP's) against the CRC-32 its zip records carry.

``lightning-zero3 verify DIR`` (``main``) checks a sharded checkpoint (``zero3.json``) or a Hugging Face
export (``SHA256SUMS``) without loading it into a model: one line per bad file, exit status 1 if any.

[Note: checking beside the load]
A load checks every file before any weight changes, and fails on every rank alike when one is bad. It
does so in two rounds, each ended by one exchange of what the ranks found (so no rank starts loading
into its weights while another has refused, and none waits for a rank that gave up):

1. ``check_shared_files``: rank 0 checks the small files every rank reads before the weights
   (``.metadata``, ``trainer_state.pt``, the JSON files).
2. ``checking_shard_files``: the shard files ``__<r>_<k>.distcp``. Each is checked by the first rank that
   reads from it in this load (at the world size it was saved with, rank ``r`` reads exactly its own
   files), or by rank ``r mod world_size`` when none does. A helper thread of the checking rank hashes
   each file in one sequential pass through the page cache (see [Note: checking a file in one sequential
   pass] in export/digests.py) while the load goes on with what changes nothing yet: making the tensors
   the optimizer states land in and reading them, which only ``optimizer.load_state_dict`` installs once
   the ranks agreed (api.py). The weights, and states that land in place (NVMe swap files), are read
   after the agreement, from the page cache the check filled (as long as a node's share of the
   checkpoint fits in it). So the disk is read once and no file is held in memory; what the check adds is
   the hash and one copy out of the page cache on the helper thread, and the weights' reads no longer
   overlapping the disk's.

Consolidation writes into a staging file that only a complete, checked run renames into place, so its
``BackgroundCheck`` runs beside the whole consolidation and is waited for before the last tensor is
handed to the writer (consolidate.py).
"""

from __future__ import annotations

import argparse
import re
import sys
import threading
import warnings
import zipfile
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from torch.distributed.checkpoint.api import CheckpointException

from ..engine import Communicator
from .atomic import MANIFEST, CheckpointError, read_manifest
from ..export.digests import PIECE, SHA256, bad_files, file_digest
from ..export.hf import SHA256SUMS, read_sha256sums

NO_CHECKSUMS = (
    "zero3: {path} was written without checksums (by a zero3 version before they were added), so its files "
    "are checked for their sizes only; a save with this version records them."
)
_SHARD_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")
# what reading a damaged file can raise (DCP's own exception, on every rank, derives from BaseException)
READ_FAILURES = (Exception, CheckpointException)
Findings = tuple[list[str], list[str]]  # a line per bad file, a line per file that could not be checked


def _corrupt_line(path: Path, name: str, rank: Optional[int], algorithm: str, expected: str, actual: str) -> str:
    who = f"rank {rank} read it and found" if rank is not None else "found"
    return f"{path / name}: {who} the {algorithm} checksum {actual}, but it was written with {expected}"


def _check(path: Path, manifest: dict, names: list[str], rank: Optional[int]) -> Findings:
    """Check ``names``: a line per bad file (naming ``rank`` if given), and per file that could not be
    checked (unreadable, or no package for the algorithm)."""
    algorithm, expected = manifest["checksums"]["algorithm"], manifest["checksums"]["files"]
    bad: list[str] = []
    errors: list[str] = []
    for name in names:
        try:
            actual = file_digest(path / name, algorithm)
        except (OSError, RuntimeError) as error:
            errors.append(f"rank {rank if rank is not None else 0}: {error}")
            if isinstance(error, RuntimeError):  # the same for every file: said once
                break
            continue
        if actual != expected[name]:
            bad.append(_corrupt_line(path, name, rank, algorithm, expected[name], actual))
    return bad, errors


def _agree(path: Path, comm: Optional[Communicator], found: Findings) -> None:
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


class BackgroundCheck:
    """``names`` of the checkpoint at ``path`` checked by a helper thread while the caller goes on;
    ``found()`` waits for the findings. ``failed()`` says early whether a bad file was found."""

    def __init__(self, path: Path, manifest: dict, names: list[str], rank: Optional[int]) -> None:
        self._found: Findings = ([], [])

        def run() -> None:
            try:
                self._found = _check(path, manifest, names, rank)
            except Exception as error:  # noqa: BLE001 - reported as a file that could not be checked
                self._found = ([], [f"rank {rank or 0}: {type(error).__name__}: {error}"])

        self._thread = threading.Thread(target=run, name="zero3-checksum", daemon=True)
        self._thread.start()

    def failed(self) -> bool:
        return not self._thread.is_alive() and any(self._found)

    def found(self) -> Findings:
        self._thread.join()
        return self._found


def check_shared_files(path: Path, manifest: dict, comm: Communicator) -> bool:
    """Round 1 of [Note: checking beside the load] (a collective): rank 0 checks every file but the
    shard files. False (and one warning) for a checkpoint written without checksums."""
    if not _has_checksums(path, manifest, comm.rank):
        return False
    shared = [name for name in manifest["checksums"]["files"] if not _SHARD_FILE.match(name)]
    _agree(path, comm, _check(path, manifest, shared, 0) if comm.rank == 0 else ([], []))
    return True


@contextmanager
def checking_shard_files(path: Path, manifest: dict, comm: Communicator, reads: set[str]) -> Iterator[None]:
    """Round 2 of [Note: checking beside the load] (a collective): the shard files checked, each by one
    rank (``reads``: the files this rank's load reads), by a helper thread while the body runs; on exit
    every rank has the findings, and raises the same ``CheckpointError`` if a file is bad. The body must
    change nothing the run uses. An error the body raised is raised after the exchange (a bad file
    explains it better, and every rank takes part in the exchange)."""
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
    check = BackgroundCheck(path, manifest, mine, comm.rank)
    failure = None
    try:
        yield
    except READ_FAILURES as error:
        failure = error
    _agree(path, comm, check.found())  # outside the except: the checksum error is the whole story
    if failure is not None:
        raise failure


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


def check_in_background(path: Path, manifest: dict) -> Optional[BackgroundCheck]:
    """Every file of the sharded checkpoint ``path`` checked against ``manifest`` by a helper thread of this
    process (consolidation; ``raise_if_bad`` waits for it); None, with one warning, for a checkpoint
    without checksums."""
    if not _has_checksums(path, manifest, 0):
        return None
    return BackgroundCheck(path, manifest, list(manifest["checksums"]["files"]), None)


def raise_if_bad(path: Path, check: BackgroundCheck) -> None:
    """Wait for ``check``; a ``CheckpointError`` naming each bad file and both checksums if one is bad."""
    _agree(path, None, check.found())


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
