"""Asynchronous reads and writes between host tensors and swap files.

Requests run on a small pool of threads: ``os.preadv`` / ``os.pwrite`` release the GIL while the kernel
copies, so disk transfers proceed while the main thread computes (or steps the optimizer). Each
request is cut into pieces of at most ``chunk_bytes``. A request returns a ``concurrent.futures.Future``;
its ``result()`` re-raises a failure in the caller's thread, a full disk as ``SwapDiskFullError``.

Writes are buffered file I/O. Reads bypass the page cache where they can: see [Note: direct reads]. The
benchmarks measure the disk's sequential bandwidth with the same calls, so the figures compare like with
like.

[Note: direct reads]
A buffered read costs the CPU a copy from the page cache into the tensor, and dropping those pages again
afterwards (below): many times the CPU time of the same reads with ``O_DIRECT``, where the disk writes
straight into the tensor's pages, at the same bandwidth or better. Streaming a model from NVMe reads
several times its size per step (per generated token, in inference), so that CPU time competes with
compute. So every swap file also has an ``O_DIRECT`` descriptor (where the file system allows one), and a
read whose tensor and file offset are aligned to ``DIRECT_ALIGN`` bytes (the engine's host buffers are
page-aligned maps, the files' pieces start at aligned offsets) reads its whole aligned blocks through it,
and only the tail of fewer than ``DIRECT_ALIGN`` bytes through the cache. Direct reads see data written
through the buffered descriptor: the kernel writes a range's dirty pages back before it reads that range
directly. A file system that accepts the flag at open but refuses the reads falls back to buffered
reads for that file.

[Note: the swap files really are read]
The kernel keeps what was read (and written) in its page cache while memory allows, so a second read of
a swap file would come from memory, not from the disk: on a machine with plenty of RAM, an "NVMe" tier
would then be a host tier in disguise, and speeds measured on it would not hold for models larger than
memory. So every read drops the pages it read from the cache (``posix_fadvise(DONTNEED)``; written pages
are dropped once the kernel has written them back, at the latest by the read that follows): reads of
the NVMe tier are reads of the disk.
"""

from __future__ import annotations

import errno
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import torch

from .swapdir import SwapFile, disk_full

DIRECT_ALIGN = 4096  # bytes: memory address, file offset and length of a direct read are multiples of it


@dataclass
class IOStats:
    """Bytes and busy seconds of the NVMe tier, per direction."""

    read_bytes: int = 0  # counted as reads complete (on the I/O threads)
    requested_read_bytes: int = 0  # counted as reads are asked for (on the caller's thread: no race)
    write_bytes: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0
    waited_seconds: float = 0.0  # time the compute side blocked on a transfer


def _byte_view(tensor: torch.Tensor) -> memoryview:
    assert tensor.device.type == "cpu" and tensor.is_contiguous()
    return memoryview(tensor.view(torch.uint8).numpy()).cast("B")


class AsyncFileIO:
    def __init__(self, chunk_bytes: int, threads: int = 2) -> None:
        self.chunk_bytes = max(1, chunk_bytes)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="zero3-swap")
        self.stats = IOStats()

    def write(self, swap: SwapFile, tensor: torch.Tensor, offset: int = 0, ready=None) -> Future:
        """Write ``tensor``'s bytes at byte ``offset`` of ``swap`` (after ``ready()``, e.g. waiting for the
        copy that fills it); the future keeps ``tensor`` alive and returns it when done."""
        return self.pool.submit(self._write, swap, tensor, offset, ready)

    def read(self, swap: SwapFile, tensor: torch.Tensor, offset: int = 0) -> Future:
        """Fill ``tensor`` from byte ``offset`` of ``swap``."""
        self.stats.requested_read_bytes += tensor.numel() * tensor.element_size()
        return self.pool.submit(self._read, swap, tensor, offset)

    def wait(self, future: Future):
        start = time.perf_counter()
        result = future.result()
        self.stats.waited_seconds += time.perf_counter() - start
        return result

    def _write(self, swap: SwapFile, tensor: torch.Tensor, offset: int, ready=None) -> torch.Tensor:
        if ready is not None:
            ready()
        start = time.perf_counter()
        nbytes = write_range(swap, tensor, offset, self.chunk_bytes)
        self.stats.write_bytes += nbytes
        self.stats.write_seconds += time.perf_counter() - start
        return tensor

    def _read(self, swap: SwapFile, tensor: torch.Tensor, offset: int) -> torch.Tensor:
        start = time.perf_counter()
        nbytes = read_range(swap, tensor, offset, self.chunk_bytes)
        self.stats.read_bytes += nbytes
        self.stats.read_seconds += time.perf_counter() - start
        return tensor

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def write_range(swap: SwapFile, tensor: torch.Tensor, offset: int, chunk_bytes: int = 1 << 26) -> int:
    """Write ``tensor``'s bytes at byte ``offset`` of ``swap`` (in the calling thread); returns the bytes."""
    view = _byte_view(tensor)
    done = 0
    try:
        while done < len(view):
            done += os.pwrite(swap.fd, view[done : done + chunk_bytes], offset + done)
    except OSError as error:
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            raise disk_full(swap.path.parent, len(view) - done, error) from error
        raise
    return len(view)


def read_range(swap: SwapFile, tensor: torch.Tensor, offset: int, chunk_bytes: int = 1 << 26) -> int:
    """Fill ``tensor`` from byte ``offset`` of ``swap`` (in the calling thread); returns the bytes. Whole
    aligned blocks are read directly where possible: see [Note: direct reads]."""
    view = _byte_view(tensor)
    direct_fd = swap.direct_fd  # read once: another thread may turn direct reads off meanwhile
    direct = _direct_bytes(direct_fd, tensor, offset, len(view))
    if direct:
        aligned_chunk = max(DIRECT_ALIGN, chunk_bytes // DIRECT_ALIGN * DIRECT_ALIGN)
        try:
            _read_all(swap, direct_fd, view[:direct], offset, aligned_chunk)
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise
            swap.no_direct()
            direct = 0
    _read_all(swap, swap.fd, view[direct:], offset + direct, chunk_bytes)
    _forget(swap, offset, len(view))
    return len(view)


def _direct_bytes(direct_fd: Optional[int], tensor: torch.Tensor, offset: int, nbytes: int) -> int:
    """How many leading bytes of a read may go through the ``O_DIRECT`` descriptor (0: none)."""
    if direct_fd is None or tensor.data_ptr() % DIRECT_ALIGN or offset % DIRECT_ALIGN:
        return 0
    return nbytes // DIRECT_ALIGN * DIRECT_ALIGN


def _read_all(swap: SwapFile, fd: int, view: memoryview, offset: int, chunk_bytes: int) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done : done + chunk_bytes]], offset + done)
        if got == 0:
            raise OSError(errno.EIO, f"zero3: swap file {swap.path} is shorter than expected (truncated?)")
        done += got


def _forget(swap: SwapFile, offset: int, nbytes: int) -> None:
    """Drop the pages just read from the page cache: see [Note: the swap files really are read]."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(swap.fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
