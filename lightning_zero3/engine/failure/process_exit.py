"""Process groups closed before the interpreter exits.

[Note: process groups closed at exit]
Lightning's strategies leave the default process group open when a run ends (a Trainer may ``validate``
or ``test`` after ``fit`` in the same processes), and scripts rarely call ``destroy_process_group``
themselves. torch then leaves the group to the interpreter's exit, and under gloo that ends a good share
of processes with SIGABRT, "terminate called without an active exception", after all the work is done.
A job scheduler counts such a run as failed.

Why: a gloo worker thread
(``pt_gloo_runloop``) drops its reference to a finished collective a moment after the caller was woken.
When that is the last reference to a tensor Python created, dropping it takes the GIL. If the main thread
reaches the interpreter's finalization first, Python ends any thread that asks for the GIL from then on
with ``pthread_exit``, whose unwinding through the collective's destructor (``noexcept``) is the
``std::terminate``. Destroying the groups is not enough by itself: ``destroy_process_group`` only drops
``torch.distributed``'s own references, and a group's threads are joined when its last handle goes. The
engine's ``Communicator`` holds the job's, the reduce-scatter and the check groups, so their threads
would live on into the finalization even after ``destroy_process_group``.

Python threads of our own hit the same wall: a watchdog (``watchdog.py``) still beating when its rank
finalizes, inside a store call while the store's host (rank 0) has already gone, aborts the process
(``tests/scripts/fabric_run.py`` holds the case: nine Fabric strategies in one process, none torn down,
since Fabric never calls ``teardown``).

So once a zero3 engine or strategy has run in a process, an ``atexit`` handler (``close_process_groups``),
while the interpreter is still whole: stops every watchdog still running (oldest first; rank 0 waits, as
in ``Watchdog.stop``, until its peers are done with the store it hosts); destroys every process group;
lets every ``Communicator`` drop its handles, so that every group nobody else holds is freed now, its
destructor joining its threads with the GIL released (their last decrefs run then); if gloo threads are
left, collects garbage (a dropped model's DDP module in a reference cycle; not by default, since a
collection is slow in a process that imported transformers, and the interpreter's finalization runs one
anyway); and if some are still left (a group the user's live objects hold), sleeps a moment
with the GIL released, time for a thread waiting for it to finish its decref. Scripts that drive
``Zero3Engine`` themselves may call ``lightning_zero3.close_process_groups()`` at their end to the same
effect.

After a failure in this process a collective may still be queued that no peer will join. Destroying a
gloo group waits for it only until the peer's connection closes, which the watchdog makes happen within
its interval (peers of a failed rank end); an NCCL group could wait for its kernels for the whole
timeout, so a failed NCCL run leaves its groups to the exit as torch does.
"""

from __future__ import annotations

import atexit
import gc
import os
import time

import torch.distributed as dist

from ..comm.communicator import forget_process_groups
from .watchdog import stop_running_watchdogs

# how long the main thread lets go of the GIL for gloo threads that outlive ``close_process_groups``
GIL_HANDOFF_SECONDS = 0.05

_registered = False
_failed = False


def close_process_groups_at_exit() -> None:
    """Run ``close_process_groups`` when the interpreter exits (registered once per process)."""
    global _registered
    if not _registered:
        atexit.register(_close)
        _registered = True


def note_failure() -> None:
    """A run failed in this process (see the note above for what that changes at exit)."""
    global _failed
    _failed = True


def close_process_groups() -> None:
    """Stop zero3's running watchdogs, destroy torch.distributed's process groups (if still open) and let
    gloo's threads end before the interpreter does: see [Note: process groups closed at exit]. Call it
    when no collective is in flight on any rank (after the last one, or after a barrier); rank 0 waits
    (at most the watchdog's ``stale_after``) until its peers have stopped their watchdogs too."""
    stop_running_watchdogs()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    forget_process_groups()  # a group only an engine held goes now, its threads joined
    if gloo_threads() != 0:
        gc.collect()  # groups held by garbage in reference cycles, as a dropped DDP model (see the note)
        if gloo_threads() != 0:
            time.sleep(GIL_HANDOFF_SECONDS)


def gloo_threads() -> int:
    """How many of gloo's worker threads this process still runs (-1: no ``/proc`` to count them in)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return -1
    count = 0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as name:
                count += name.read().strip() == "pt_gloo_runloop"
        except OSError:  # the thread ended meanwhile
            pass
    return count


def _close() -> None:
    if _failed and dist.is_available() and dist.is_initialized() and dist.get_backend() != "gloo":
        stop_running_watchdogs()
        return
    close_process_groups()
