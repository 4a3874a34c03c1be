"""Offload: optimizer state, master and gradient shards in host memory or on NVMe; parameter shards
streamed to the device just in time.

- ``tiers.py``          what a run's groups share: tiers, copies, swap folder, I/O, host buffer pool
- ``resources.py``      the shared tiers plus every group's store and source
- ``store.py``          one group's master / gradient / optimizer state in its tier (residency, accumulation)
- ``source.py``         what one group's all-gathers read from, per parameter tier
- ``streaming.py``      walking every group with a read-ahead window (step, gradient passes, checkpoints)
- ``host_optimizer.py`` the user's optimizer stepped on the host, group by group, pipelined with I/O
- ``aio.py``            asynchronous reads and writes of swap files on a thread pool
- ``swapdir.py``        the private swap folder: checks, allocation, clean-up (also after a crash)
- ``copies.py``         device <-> host copies (side stream and pinned staging on CUDA)

Imports: ``memory`` (and the package's ``errors``, and ``config`` for the tier names); the shard above hands each store the views it needs.
"""

from .aio import AsyncFileIO, IOStats
from .host_optimizer import PipelinedStep, make_host_fused, restore_flags
from .resources import Offload
from .source import ParamSource
from .store import GroupStore, ShardView
from .swapdir import NvmePathError, SwapDirectory, SwapDiskFullError

__all__ = [
    "AsyncFileIO",
    "GroupStore",
    "IOStats",
    "NvmePathError",
    "Offload",
    "ParamSource",
    "PipelinedStep",
    "ShardView",
    "SwapDirectory",
    "SwapDiskFullError",
    "make_host_fused",
    "restore_flags",
]
