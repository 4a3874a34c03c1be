"""The C library, loaded once for the modules that call it directly (page maps, ``mremap``, ``mincore``,
glibc's heap): ``None`` where the system has none to load (not POSIX)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True) if os.name == "posix" else None
