"""Allocator figures: how much of the memory the allocator holds is unusable slack (fragmentation).

On CUDA, from the caching allocator (``torch.cuda.memory_stats``):
  - ``fragmentation`` = inactive split bytes / reserved bytes: blocks split off and now free but too
    small or misplaced to serve the next request;
  - ``cached_slack`` = 1 - allocated / reserved: everything reserved but unused;
  - ``alloc_retries``: times the allocator had to free its cache and retry (``num_alloc_retries``), since
    the monitor started. Retries are the cost of fragmentation: each one synchronises the device.

On the host, from glibc's ``mallinfo2()`` and the kernel:
  - ``fragmentation`` = free bytes inside malloc's heap arenas / arena bytes (``fordblks / arena``):
    memory malloc holds from the OS but cannot give back;
  - ``rss_bytes`` (``/proc/self/statm``) and ``engine_share_of_rss`` = the bytes the engine knows it holds
    / RSS (the rest is the interpreter, libraries, activations and allocator slack).
  glibc's malloc has no retry: a request is served from the heap or from the OS, or fails. So
  ``alloc_retries`` is logged on CUDA only. Without glibc 2.33+ (no ``mallinfo2``) only the RSS figures
  are logged.
"""

from __future__ import annotations

import ctypes
import os
from typing import Optional

import torch

from ..engine.memory.libc import LIBC


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
    ]


def _load_mallinfo2():
    try:
        function = LIBC.mallinfo2  # glibc 2.33+
    except AttributeError:  # another C library, an older glibc, or none (LIBC is None)
        return None
    function.restype = _Mallinfo2
    return function


_MALLINFO2 = _load_mallinfo2()
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def _main_heap_resident_bytes() -> Optional[int]:
    """Resident bytes of the process's main heap (the ``[heap]`` mapping in ``/proc/self/smaps``)."""
    try:
        with open("/proc/self/smaps") as f:
            in_heap = False
            for line in f:
                if not line[0].isupper():  # a mapping's header line starts with its address
                    in_heap = line.rstrip().endswith("[heap]")
                elif in_heap and line.startswith("Rss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return 0


def host_figures(engine_bytes: int) -> dict[str, float]:
    figures: dict[str, float] = {}
    if _MALLINFO2 is not None:
        info = _MALLINFO2()
        figures["fragmentation"] = info.fordblks / info.arena if info.arena else 0.0
        figures["heap_arena_bytes"] = float(info.arena)
        figures["heap_free_bytes"] = float(info.fordblks)
        # Free heap bytes are not all memory: zero3 returns free pages inside the heap to the kernel where a
        # phase ends (malloc_trim), so they stay counted as free while nothing holds them. What is wasted is
        # the free part of what the main heap keeps resident.
        heap_resident = _main_heap_resident_bytes()
        if heap_resident is not None:
            used = info.arena - info.fordblks
            figures["heap_free_resident_bytes"] = float(max(0, min(info.fordblks, heap_resident - used)))
        figures["mmapped_bytes"] = float(info.hblkhd)
    if os.path.exists("/proc/self/statm"):
        rss = rss_bytes()
        figures["rss_bytes"] = float(rss)
        figures["engine_share_of_rss"] = engine_bytes / rss if rss else 0.0
    return figures


def cuda_figures(device: torch.device, retries_at_start: int) -> dict[str, float]:
    stats = torch.cuda.memory_stats(device)
    reserved = stats.get("reserved_bytes.all.current", 0)
    allocated = stats.get("allocated_bytes.all.current", 0)
    inactive = stats.get("inactive_split_bytes.all.current", 0)
    return {
        "fragmentation": inactive / reserved if reserved else 0.0,
        "cached_slack": 1 - allocated / reserved if reserved else 0.0,
        "alloc_retries": float(stats.get("num_alloc_retries", 0) - retries_at_start),
        "reserved_bytes": float(reserved),
        "allocated_bytes": float(allocated),
    }


def cuda_retries(device: torch.device) -> int:
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


def allocator_figures(device: torch.device, engine_bytes: int, retries_at_start: Optional[int]) -> dict[str, float]:
    """The figures above for the allocator that serves ``device``."""
    if device.type == "cuda":
        return cuda_figures(device, retries_at_start or 0)
    return host_figures(engine_bytes)
