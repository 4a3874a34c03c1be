"""Byte ranges of a checkpoint file, read into a staging buffer piece by piece and handed on.

[Note: reading a checkpoint's byte ranges]
Each rank reads only the ranges of its shards, and casts them (bf16 in the file, fp32 masters) as they
come. Through a memory map the cast faults the file's pages in one by one behind the read-ahead, and
every page read through the page cache is copied once more by the kernel; reading with ``O_DIRECT`` into
a staging buffer and casting from there comes closest to what the disk alone takes. So a file is read with ``O_DIRECT`` into a
page-aligned staging buffer (whole aligned blocks around the range asked for), falling back to
buffered reads on a file system that refuses the flag (then the pages read are dropped from the cache
again), and the next piece is read on a helper thread while this one is cast (``os.preadv`` releases
the GIL).
"""

from __future__ import annotations

import errno
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional

import torch

from ..engine.memory.buffers import host_buffer

ALIGN = 4096  # O_DIRECT: memory address, file offset and length are multiples of it
PIECE = 8 << 20  # bytes read per request


class CheckpointFile:
    """One file of a checkpoint, open for ranged reads (see [Note: reading a checkpoint's byte ranges])."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: Optional[int] = None
        self._direct: Optional[int] = None
        self._staging: list[torch.Tensor] = []
        self._pool: Optional[ThreadPoolExecutor] = None

    def _open(self) -> None:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
            try:
                self._direct = os.open(self.path, os.O_RDONLY | os.O_DIRECT) if hasattr(os, "O_DIRECT") else None
            except OSError:  # tmpfs and some network file systems
                self._direct = None
            self._staging = [host_buffer(PIECE + 2 * ALIGN, torch.uint8) for _ in range(2)]  # page-aligned maps
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="zero3-checkpoint-read")

    def read(self, start: int, end: int, consume: Callable[[int, torch.Tensor], None]) -> None:
        """Read bytes ``[start, end)`` and call ``consume(offset, data)`` for each piece in order, ``data``
        a uint8 tensor valid only during the call, ``offset`` its position from ``start``."""
        if end <= start:
            return
        self._open()
        pieces = [(lo, min(lo + PIECE, end)) for lo in range(start, end, PIECE)]
        pending: Optional[Future] = self._pool.submit(self._read_piece, *pieces[0], 0)
        for index, (lo, hi) in enumerate(pieces):
            data = pending.result()
            pending = self._pool.submit(self._read_piece, *pieces[index + 1], (index + 1) % 2) if index + 1 < len(pieces) else None
            consume(lo - start, data)
        if self._direct is None:
            os.posix_fadvise(self._fd, start, end - start, os.POSIX_FADV_DONTNEED)

    def _read_piece(self, lo: int, hi: int, slot: int) -> torch.Tensor:
        buffer = self._staging[slot]
        first = lo // ALIGN * ALIGN if self._direct is not None else lo
        last = -(-hi // ALIGN) * ALIGN if self._direct is not None else hi
        view = memoryview(buffer.numpy())[: last - first]
        done = 0
        while first + done < hi:
            try:
                got = os.preadv(self._direct if self._direct is not None else self._fd, [view[done:]], first + done)
            except OSError as error:
                if error.errno != errno.EINVAL or self._direct is None:
                    raise
                self._direct = None  # accepted at open, refused on reads: through the cache from here on
                return self._read_piece(lo, hi, slot)
            if got == 0:
                raise OSError(errno.EIO, f"zero3: {self.path} ended at byte {first + done}, before byte {hi}")
            done += got
        return buffer[lo - first : hi - first]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for fd in (self._direct, self._fd):
            if fd is not None:
                os.close(fd)
        self._fd = self._direct = None
        self._staging = []
