"""Figures of this process and machine read from Linux's ``/proc``: the one reader of its ``Key:  N kB``
files (``/proc/self/status`` for ``VmRSS`` / ``VmHWM``, ``/proc/meminfo`` for ``MemTotal`` / ``MemAvailable``)."""

from __future__ import annotations

from typing import Optional

STATUS = "/proc/self/status"
MEMINFO = "/proc/meminfo"


def kib_field_bytes(path: str, key: str) -> Optional[int]:
    """The ``key:  N kB`` line of ``path`` in bytes; None where the file or the line is missing (no ``/proc``)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
