"""Checksums of checkpoint files: computed while the bytes are written, checked before anything is read.

[Note: checksums while the bytes stream out]
Every file of a sharded checkpoint passes through ``DigestingStream`` on its way to the disk, so its
checksum is computed from the bytes already in memory, with no second read of what was written; the
manifest (``zero3.json``, see atomic.py) records each file's checksum next to its size, and a checksum
of its own body. A size catches a truncated file; only a checksum catches bytes flipped in place (a bad
disk, a network filesystem, a copy between clusters), which load as plausible numbers and poison the run.

The algorithm is ``xxh3_64`` (the ``xxhash`` package, a dependency of zero3), which hashes at memory
speed; each manifest names the algorithm it used, so verification never guesses. Without ``xxhash``
installed, saves fall back to the standard library's ``zlib.crc32`` (several times slower, with a
warning), and a checkpoint written with ``xxh3_64`` cannot be verified until ``xxhash`` is installed.
"""

from __future__ import annotations

import hashlib
import io
import json
import mmap
import os
import re
import threading
import warnings
import zlib
from pathlib import Path
from typing import Any, Callable, Optional, Union

CHUNK = 8 << 20  # bytes hashed at a time when verifying a file
XXH3 = "xxh3_64"
CRC32 = "crc32"
SHA256 = "sha256"  # what the Hugging Face Hub records per file: the manifest of exports (``SHA256SUMS``)


class _Crc32:
    """``zlib.crc32`` behind the ``update`` / ``hexdigest`` interface of hashlib and xxhash."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Any) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def _xxh3() -> Optional[Callable[[], Any]]:
    try:
        import xxhash
    except ImportError:
        return None
    return xxhash.xxh3_64


def writing_algorithm() -> str:
    """The algorithm new checkpoints are written with: ``xxh3_64``, or ``crc32`` without ``xxhash``."""
    if _xxh3() is not None:
        return XXH3
    warnings.warn(
        "zero3: the `xxhash` package is not installed, so checkpoint checksums use zlib.crc32, several times "
        "slower; `pip install xxhash` (a dependency of lightning-zero3) makes them cheap again.",
        stacklevel=3,
    )
    return CRC32


def new_digest(algorithm: str) -> Any:
    """A running checksum of ``algorithm``: ``update(bytes)``, then ``hexdigest()``."""
    if algorithm == CRC32:
        return _Crc32()
    if algorithm == SHA256:
        return hashlib.sha256()
    if algorithm == XXH3:
        make = _xxh3()
        if make is None:
            raise RuntimeError(
                "zero3: this checkpoint's checksums are xxh3_64, which needs the `xxhash` package to verify; "
                "install it (`pip install xxhash`, a dependency of lightning-zero3) and load again."
            )
        return make()
    raise RuntimeError(f"zero3: unknown checksum algorithm {algorithm!r} in the checkpoint's manifest.")


def bytes_digest(data: Union[bytes, str], algorithm: str) -> str:
    digest = new_digest(algorithm)
    digest.update(data.encode() if isinstance(data, str) else data)
    return digest.hexdigest()


def file_digest(path: Path, algorithm: str) -> str:
    """The checksum of the file at ``path``, hashed straight from a read-only mapping of it.

    [Note: checking a file before the load]
    The file is mapped, not read into a buffer: the hash reads the page cache itself (no copy into the
    process), with sequential advice so that the kernel reads ahead while earlier pages are hashed. The
    pages stay cached, so the load that follows copies them from memory rather than from the disk (as long
    as a node's share of the checkpoint fits in its page cache); the check is still one more pass over
    every byte before the load's own. Each chunk is unmapped from the process once hashed, so the check
    holds at most one chunk of the file in its resident memory."""
    digest = new_digest(algorithm)
    with open(path, "rb") as stream:
        size = os.fstat(stream.fileno()).st_size
        if size == 0:
            return digest.hexdigest()
        with mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            advise = getattr(mapped, "madvise", None)
            if advise is not None:
                advise(mmap.MADV_SEQUENTIAL)
            view = memoryview(mapped)
            try:
                for start in range(0, size, CHUNK):
                    digest.update(view[start : start + CHUNK])
                    if advise is not None:  # out of this process's mapping (the page cache keeps them)
                        advise(mmap.MADV_DONTNEED, start, min(CHUNK, size - start))
            finally:
                view.release()
    return digest.hexdigest()


def body_digest(body: dict, algorithm: str) -> str:
    """The checksum of a manifest's content, independent of how the JSON is laid out in the file."""
    return bytes_digest(json.dumps(body, sort_keys=True, separators=(",", ":")), algorithm)


class DigestingStream(io.RawIOBase):
    """A binary file opened for writing whose every written byte also goes into ``digest``."""

    def __init__(self, raw: Any, digest: Any) -> None:
        super().__init__()
        self.raw, self.digest = raw, digest

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.digest.update(view)
        written = self.raw.write(view)
        if written is not None and written != len(view):  # a raw stream may write less: finish it here
            self.raw.write(view[written:])
        return len(view)

    def tell(self) -> int:
        return self.raw.tell()

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        if not self.raw.closed:  # also called when this wrapper is collected, after the file was closed
            self.raw.flush()


class DigestBook:
    """The checksums of the files one process writes into a checkpoint directory, by name in the directory.
    Thread-safe: DCP may write several files at once."""

    def __init__(self, algorithm: str) -> None:
        self.algorithm = algorithm
        self.digests: dict[str, str] = {}
        self._pending: dict[str, Any] = {}
        self._lock = threading.Lock()

    def stream(self, raw: Any, name: str) -> DigestingStream:
        """Wrap ``raw``, opened for writing the file ``name``; its checksum is recorded on ``close``."""
        digest = new_digest(self.algorithm)
        with self._lock:
            self._pending[name] = digest
        return DigestingStream(raw, digest)

    def close(self, name: str) -> None:
        with self._lock:
            self.digests[name] = self._pending.pop(name).hexdigest()

    def rename(self, old: str, new: str) -> None:
        with self._lock:
            self.digests[new] = self.digests.pop(old)

    def add(self, name: str, content: Union[bytes, str]) -> None:
        """Record a file whose whole content is in memory (a small text file)."""
        with self._lock:
            self.digests[name] = bytes_digest(content, self.algorithm)


# -- which rank checks which file on load ------------------------------------------------------------

_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


def checking_rank(name: str, world_size: int) -> int:
    """The rank that verifies the file ``name`` when a checkpoint loads on ``world_size`` ranks.

    [Note: each file checked by one rank, the outcome agreed by all]
    Every file is read once by one rank before any rank reads a weight: a shard file ``__<r>_<k>.distcp``
    by rank ``r mod world_size`` (at the world size it was saved with, each rank checks exactly the files
    it is about to load, so the pages it read stay warm for the load), the small shared files by rank 0.
    The ranks then exchange what they found, and all raise the same error if any file is bad: no rank
    starts loading while another has refused, and none waits for a rank that gave up."""
    match = _RANK_FILE.match(name)
    return int(match.group(1)) % world_size if match else 0


def bad_files(directory: Path, names: list[str], expected: dict[str, str], algorithm: str) -> list[tuple[str, str, str]]:
    """``(name, expected, actual)`` for each of ``names`` whose checksum differs from the manifest's."""
    bad = []
    for name in names:
        actual = file_digest(directory / name, algorithm)
        if actual != expected[name]:
            bad.append((name, expected[name], actual))
    return bad
