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
import os
import threading
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional, Union

PIECE = 8 << 20  # bytes read and hashed at a time when checking a file
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
    """The checksum of the file at ``path``, from one sequential pass over it.

    [Note: checking a file in one sequential pass]
    A helper thread reads the file in ``PIECE``-sized pieces into two reused buffers (``os.preadv`` lets
    go of the GIL), with sequential read-ahead advice, while this thread hashes the piece before, so the
    hash runs while the disk reads. The file's pages stay in the page cache for whatever reads the file
    next (a load, see [Note: checking beside the load] in checkpoint/verify.py). A memory map is not
    used: faulting a cold file in page by page is several times slower than these reads on a virtual disk."""
    digest = new_digest(algorithm)
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        staging = [bytearray(min(PIECE, size)) for _ in range(2)]
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        starts = range(0, size, PIECE)

        def read(index: int) -> memoryview:
            lo = starts[index]
            return _read_fully(fd, memoryview(staging[index % 2])[: min(PIECE, size - lo)], lo, path)

        with ThreadPoolExecutor(1, thread_name_prefix="zero3-checksum-read") as pool:
            pending = pool.submit(read, 0) if starts else None
            for index in range(len(starts)):
                piece = pending.result()
                pending = pool.submit(read, index + 1) if index + 1 < len(starts) else None
                digest.update(piece)
    finally:
        os.close(fd)
    return digest.hexdigest()


def _read_fully(fd: int, view: memoryview, offset: int, path: Path) -> memoryview:
    """Read into ``view`` from ``offset`` until it is full or the file ends; the part read."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            break
        done += got
    return view[:done]


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


def bad_files(directory: Path, names: list[str], expected: dict[str, str], algorithm: str) -> list[tuple[str, str, str]]:
    """``(name, expected, actual)`` for each of ``names`` whose checksum differs from the manifest's."""
    bad = []
    for name in names:
        actual = file_digest(directory / name, algorithm)
        if actual != expected[name]:
            bad.append((name, expected[name], actual))
    return bad
