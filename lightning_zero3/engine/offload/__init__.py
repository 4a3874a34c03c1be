"""Offload: optimizer state, master and gradient shards in host memory or on NVMe; parameter shards
streamed to the device just in time.

- ``tiers.py``          where one group's master / gradient / state live; the gather source
- ``host_optimizer.py`` the user's optimizer stepped on the host, group by group, pipelined with I/O
- ``aio.py``            asynchronous reads and writes of swap files on a thread pool
- ``swapdir.py``        the private swap folder: checks, allocation, clean-up (also after a crash)
- ``copies.py``         device <-> host copies (side stream and pinned buffers on CUDA)
"""

from .aio import AsyncFileIO, IOStats
from .host_optimizer import PipelinedStep, make_host_fused, restore_flags
from .swapdir import NvmePathError, SwapDirectory, SwapDiskFullError
from .tiers import GroupStore, Offload

__all__ = [
    "AsyncFileIO",
    "GroupStore",
    "IOStats",
    "NvmePathError",
    "Offload",
    "PipelinedStep",
    "SwapDirectory",
    "SwapDiskFullError",
    "make_host_fused",
    "restore_flags",
]
