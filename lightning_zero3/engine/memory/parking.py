"""Pages of a released host buffer, kept for the next buffer of the same size.

[Note: released pages are parked]
A gathered buffer on the host is a memory map of its own, released with ``madvise(MADV_DONTNEED)`` (see
[Note: releasing gathered buffers] in buffers.py). The next gather into any buffer then faults every page
in afresh, and the kernel zeroes each one first; a direct read from the disk into such a buffer also
runs slower than into present pages. Generation that streams cold units from NVMe pays both per token.
Units of a model mostly have the same size (the blocks of a transformer), and one unit is released about when the next one is
gathered. So the last released buffers keep their pages ("parked", counted by the ledger as staging
bytes), and:

- gathering that same buffer again takes its pages back where they are (no copy, no fault);
- gathering another buffer of the same length moves the pages into it with
  ``mremap(MREMAP_DONTUNMAP)``: the page tables move, the parked buffer is left empty (reads zeros, as a
  released buffer may), no page is zeroed or copied;
- at most ``PARKED_BUFFERS`` buffers are parked: releasing one more hands the oldest's pages back to the
  kernel, as ``flush`` does for all where a phase ends (after ``fit``, a stage, a checkpoint).

A buffer moved into must hold no pages of its own: only buffers released through this module (and not
reclaimed since) are moved into, and only a buffer that is parked is moved from. On kernels without
``MREMAP_DONTUNMAP`` (before Linux 5.7) the first failed move turns parking off: buffers are then
released with ``madvise`` alone.
"""

from __future__ import annotations

import ctypes
import mmap
import weakref
from typing import Any, Callable, Optional

from .libc import LIBC as _LIBC

if _LIBC is not None:
    _LIBC.mremap.restype = ctypes.c_void_p
    _LIBC.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
_MREMAP_MAYMOVE, _MREMAP_FIXED, _MREMAP_DONTUNMAP = 1, 2, 4


class _Parked:
    """A buffer whose pages are parked: its map (weakly: a map that dies takes its pages with it),
    where its pages start, how many bytes, and the ledger entry that counts them until they are taken."""

    def __init__(self, region: mmap.mmap, offset: int, length: int, uncount: Callable[[], None]) -> None:
        self.region = weakref.ref(region, lambda _: _forget(self))
        self.offset = offset  # where in the map the pages start
        self.address = address(region) + offset
        self.length = length
        self.uncount = uncount  # takes the parked bytes off the ledger that counted them


#: buffers whose pages may be parked at once: two, so that two units streamed one after the other (each
#: released, then read again for the next call) both find pages when their reads start
PARKED_BUFFERS = 2
_parked: list[_Parked] = []  # oldest first
_moves_work = _LIBC is not None and hasattr(_LIBC, "mremap")


def _forget(parked: _Parked) -> None:
    if parked in _parked:
        _parked.remove(parked)
        parked.uncount()


def can_park() -> bool:
    return _moves_work


def address(region: mmap.mmap) -> int:
    """Where ``region`` starts in this process's address space."""
    return ctypes.addressof(ctypes.c_char.from_buffer(region))


def park(region: mmap.mmap, offset: int, length: int, uncount: Callable[[], None]) -> None:
    """Keep the pages of a just released buffer (``length`` bytes at ``offset`` inside ``region``); the
    caller has counted them and ``uncount`` takes them off again. Beyond ``PARKED_BUFFERS`` the oldest
    parked buffer is emptied."""
    _drop(next((p for p in _parked if p.region() is region), None))
    _parked.append(_Parked(region, offset, length, uncount))
    if len(_parked) > PARKED_BUFFERS:
        _drop(_parked[0])


def take(region: mmap.mmap, offset: int, length: int) -> bool:
    """Give a released buffer (``length`` bytes at ``offset`` inside ``region``, no pages of its own) parked pages that fit
    it: its own, else another buffer's of the same length. False if none were taken."""
    global _moves_work
    own = next((p for p in _parked if p.region() is region), None)
    if own is not None:
        _forget(own)
        return True
    parked = next((p for p in _parked if p.length == length), None)
    if parked is None:
        return False
    target = address(region) + offset
    moved = _LIBC.mremap(parked.address, length, length, _MREMAP_MAYMOVE | _MREMAP_FIXED | _MREMAP_DONTUNMAP, target)
    if moved != target:  # an older kernel (no MREMAP_DONTUNMAP), or a map the kernel will not move
        _moves_work = False
        flush()
        return False
    _forget(parked)
    return True


def holds(region: Any) -> bool:
    """Whether ``region``'s pages are parked."""
    return region is not None and any(p.region() is region for p in _parked)


def _drop(parked: Optional[_Parked]) -> None:
    """Hand one parked buffer's pages back to the kernel."""
    if parked is None:
        return
    region = parked.region()
    if region is not None:
        region.madvise(mmap.MADV_DONTNEED, parked.offset, parked.length)
    _forget(parked)


def flush() -> None:
    """Hand every parked page back to the kernel."""
    for parked in list(_parked):
        _drop(parked)
