"""How many compute threads a rank on CPU uses: its cores, shared with the job's other ranks on them.

[Note: the CPU thread budget]
Ranks on one machine that each run as many threads as the machine has cores oversubscribe it, and a
step then waits on the slowest descheduled thread. So each rank takes ``cores // sharing`` threads
(never fewer than one), where ``cores`` are the CPUs this process may run on (its affinity mask, which
a scheduler's cpuset or ``--cpu-bind`` has already narrowed) and ``sharing`` counts the ranks of this
job, itself included, that run on the same machine *and* may run on some of the same cores.

``sharing`` is found by all-gathering, once the process group exists, each rank's machine and core
set; the launchers' own counts are not used because each says something else:
- ``devices`` (Lightning) and ``LOCAL_WORLD_SIZE`` (torchrun) / ``SLURM_NTASKS_PER_NODE`` count the
  ranks one launch started on a node, not the ranks on the machine: two torchrun agents (or two
  simulated nodes, as the tests run) on one host would each claim all of its cores;
- ranks that a scheduler pinned to separate cores do not share them, and dividing each one's few
  cores again by the ranks on the node would leave cores idle.
The machine is the running kernel's ``boot_id`` (one per booted machine or VM, shared by containers
on it, whose cpusets then tell them apart), or the host name where there is none. Ranks of *other*
jobs on the machine are not in this process group and cannot be counted: separating jobs is the
scheduler's cpuset's job, which the affinity mask reflects.

The budget is set in ``Zero3Strategy.setup_environment``, right after the process group is created
and before any compute; ``cpu_threads`` overrides it.
"""

from __future__ import annotations

import os
import socket
from typing import NamedTuple, Sequence

import torch.distributed as dist

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


class CoreSet(NamedTuple):
    """The machine a rank runs on and the CPUs it may run on."""

    machine: str
    cores: frozenset[int]


def this_core_set() -> CoreSet:
    try:
        with open(_BOOT_ID) as file:
            machine = file.read().strip()
    except OSError:
        machine = socket.gethostname()
    if hasattr(os, "sched_getaffinity"):
        cores = frozenset(os.sched_getaffinity(0))
    else:  # no affinity masks (macOS): every core counts
        cores = frozenset(range(os.cpu_count() or 1))
    return CoreSet(machine, cores)


def ranks_sharing(mine: CoreSet, everyone: Sequence[CoreSet]) -> int:
    """How many of ``everyone`` (this rank included) run on this rank's machine and some of its cores."""
    return sum(1 for other in everyone if other.machine == mine.machine and other.cores & mine.cores)


def threads_per_rank(mine: CoreSet, sharing: int) -> int:
    """This rank's share of its cores (see [Note: the CPU thread budget]); at least one thread."""
    return max(1, len(mine.cores) // max(1, sharing))


def gather_core_sets(group: dist.ProcessGroup | None = None) -> tuple[CoreSet, list[CoreSet]]:
    """This rank's ``CoreSet`` and every rank's of ``group`` (a collective; one per process group)."""
    mine = this_core_set()
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return mine, [CoreSet(*entry) for entry in everyone]
