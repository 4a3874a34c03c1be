"""A watchdog per rank: when one rank fails, every rank ends with a message saying which and why.

A collective that waits for a rank that is gone, or that will never arrive (it raised), cannot be
interrupted: under NCCL it waits for the whole ``timeout``, under gloo it fails with "Connection closed
by peer", which names nobody. So each rank runs a small daemon thread on the c10d store that the
process group already uses (its own connection, ``store.clone()``):

- it beats: every ``interval`` seconds it writes a counter under ``hb/<rank>``;
- a rank that fails (``fail``, from the strategy's ``on_exception``) writes ``abort`` once
  (``compare_set``: the first cause wins) with its rank and cause, prints what more likely caused its
  own error (a rank that failed first, a peer that is gone), and goes on failing by itself;
- every other rank's thread sees ``abort`` within ``interval``, prints the failed rank and its cause,
  and ends its process;
- a rank that is gone without a word (SIGKILL, out-of-memory killer) is seen by its process id when it
  ran on this host (dead within ``interval``), else by a heartbeat that stops changing for
  ``stale_after`` seconds (half the ``timeout``, at most a minute); a lost store means its host (rank 0
  under Lightning's launcher) is gone. Either turns into the same message and exit;
- a rank whose collective can never complete, because the ranks issued different ones, finds it from
  the records every rank publishes in its heartbeat, and ends every rank with one message naming what
  each was doing (see [Note: finding collectives that cannot complete] in engine/failure/hang_check.py);
- SIGTERM to any rank ends every rank within a few seconds, with status 143, even while a collective
  waits (see [Note: SIGTERM while a collective waits] in engine/failure/termination.py);
- a rank that finished normally writes ``done/<rank>`` (``stop``), so that peers still finishing do
  not mistake its exit for a failure; rank 0 waits for the others' ``done`` before it lets its
  process (and the store in it) go.

[Note: exiting from the watchdog]
The main thread may be blocked inside a collective that no exception can reach, so the thread ends the
process with ``os._exit(1)``. That skips ``atexit`` handlers, which is where swap folders are removed:
the clean-ups registered with ``add_cleanup`` (the engine's ``remove_swap_files``) run first. Keys live
under a prefix per watchdog (``generation``), so a second ``fit`` in the same processes starts afresh.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import weakref
from datetime import timedelta
from typing import Callable, Optional

import torch.distributed as dist

from ..comm.collective_log import LOG
from .hang_check import HANG, POLL_ALL, HangCheck, decode, encode
from .termination import TERMINATED_EXIT_CODE, TerminationWatch

EXIT_CODE = 1
TERMINATED = "was terminated by SIGTERM"  # in the abort of a rank that received SIGTERM

# the watchdogs of this process whose thread runs, for ``stop_running_watchdogs``
_RUNNING: "weakref.WeakSet[Watchdog]" = weakref.WeakSet()


def stop_running_watchdogs() -> None:
    """Stop every watchdog of this process that is still running, oldest first, as the process ends: a
    Fabric script never tears its strategies down (see [Note: process groups closed at exit])."""
    for watchdog in sorted(_RUNNING, key=lambda w: w.generation):
        watchdog.stop()


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host still runs (a zombie, killed but not reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rpartition(")")[2].split()[0]
        return state not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


class Watchdog:
    """Heartbeats and the abort key of one rank (see the module note). ``start`` after the process group
    exists, ``stop`` when this rank is done, ``fail`` when it fails."""

    def __init__(
        self, store: dist.Store, rank: int, world_size: int, timeout: timedelta, generation: int = 0,
        hang_timeout: Optional[timedelta] = None, hang_idle_timeout: Optional[timedelta] = None,
    ) -> None:  # fmt: skip
        self.rank, self.world_size = rank, world_size
        seconds = timeout.total_seconds()
        self.interval = min(2.0, max(0.2, seconds / 20))
        hang = hang_timeout.total_seconds() if hang_timeout is not None else None
        idle = hang_idle_timeout.total_seconds() if hang_idle_timeout is not None else None
        if hang is not None:  # two polls after the threshold, and polls fine enough to see it
            self.interval = min(self.interval, max(0.2, hang / 4))
        self._hangs = HangCheck(rank, world_size, hang, idle) if hang is not None else None
        self._values: dict[int, bytes] = {}  # rank -> its last heartbeat value read
        self.stale_after = min(60.0, seconds / 2)
        self.generation = generation
        self.prefix = f"zero3_watchdog/{generation}/"
        self._store = store.clone()  # a connection of its own: the thread never shares the main one
        self._store.set_timeout(timedelta(seconds=max(self.stale_after, 1.0)))
        self._cleanups: list[Callable[[], None]] = []
        self._stopping = threading.Event()
        self._aborted_here = False
        self._thread: Optional[threading.Thread] = None
        self._peers = [r for r in range(world_size) if r != rank]
        # [Note: who reads whose record] in engine/failure/hang_check.py
        near = {0, (rank - 1) % world_size, (rank + 1) % world_size} - {rank}
        self._polled = self._peers if world_size <= POLL_ALL else sorted(near)
        self._ending = threading.Lock()
        self._termination = TerminationWatch(self.terminate)
        self._seen: dict[int, tuple[bytes, float]] = {}  # rank -> (last heartbeat, when it changed here)
        self._where: dict[int, tuple[str, int]] = {}  # rank -> (host, pid)
        self._started = 0.0
        self.host = socket.gethostname()
        self.exit: Callable[[int], None] = os._exit  # replaced in tests

    @classmethod
    def for_default_group(cls, timeout: timedelta, generation: int = 0, hang_timeout: Optional[timedelta] = None,
                          hang_idle_timeout: Optional[timedelta] = None) -> "Watchdog":  # fmt: skip
        from torch.distributed.distributed_c10d import _get_default_store

        store, rank, world = _get_default_store(), dist.get_rank(), dist.get_world_size()
        return cls(store, rank, world, timeout, generation, hang_timeout, hang_idle_timeout)

    def _key(self, name: str) -> str:
        return self.prefix + name

    def add_cleanup(self, cleanup: Callable[[], None]) -> None:
        """Run ``cleanup`` before this rank's process is ended by the watchdog."""
        self._cleanups.append(cleanup)

    def start(self) -> "Watchdog":
        """Publish where this rank runs and wait (at most ``stale_after``) to learn where the others do: every
        rank starts its watchdog at the same point, and a peer's process id must be known before the store
        (which may live in that peer) can vanish with it."""
        self._store.set(self._key(f"where/{self.rank}"), f"{self.host} {os.getpid()}")
        self._store.set(self._key(f"hb/{self.rank}"), "0")
        self._started = time.monotonic()
        try:
            self._store.wait([self._key(f"where/{peer}") for peer in self._peers], timedelta(seconds=self.stale_after))
            for peer in self._peers:
                host, pid = self._store.get(self._key(f"where/{peer}")).decode().split()
                self._where[peer] = (host, int(pid))
        except Exception:  # noqa: BLE001 - a peer that never came is reported by the thread
            pass
        self._thread = threading.Thread(target=self._run, name=f"zero3-watchdog-r{self.rank}", daemon=True)
        self._thread.start()
        self._termination.start()  # from the main thread: the wakeup descriptor can only be set there
        _RUNNING.add(self)
        return self

    def stop(self) -> None:
        """This rank is done (or failing and told the others so): stop the thread. Rank 0, whose process
        holds the store under Lightning's launcher, first waits (at most ``stale_after``) until every peer
        is done too, has seen the abort, or is gone: a peer's watchdog would take the store's
        disappearance for rank 0's death, and would miss the abort's cause."""
        if self._thread is None:
            return
        _RUNNING.discard(self)
        self._termination.stop()
        self._stopping.set()
        self._thread.join(timeout=2 * self.interval + 1)
        self._thread = None
        try:
            self._store.set(self._key(f"done/{self.rank}"), "1")
            self._wait_for_peers(self.stale_after)
        except Exception:  # noqa: BLE001 - the store may be gone with a peer that finished first
            pass

    def _wait_for_peers(self, seconds: float, every_rank: bool = False) -> None:
        """On rank 0 (whose process holds the store under Lightning's launcher; on every rank with
        ``every_rank``): wait at most ``seconds`` until every peer is done, has seen an abort, or is gone."""
        if self.rank != 0 and not every_rank:
            return
        deadline = time.monotonic() + seconds
        waiting = list(self._peers)
        while waiting and time.monotonic() < deadline:
            waiting = [peer for peer in waiting if self._peer_state(peer, time.monotonic()) == "running"]
            if waiting:
                time.sleep(self.interval / 4)

    def abort(self, cause: str) -> Optional[str]:
        """Tell every rank that this one fails because of ``cause``. Returns the message of a rank that
        failed first for another cause (then ``cause`` is not published), or None."""
        self._aborted_here = True
        cause = _one_line(cause)
        mine = f"rank {self.rank} failed: {cause}"
        try:
            first = self._store.compare_set(self._key("abort"), "", mine).decode()
        except Exception as error:  # noqa: BLE001 - no store: nothing to tell
            return self._store_lost(error)
        return None if first.partition(" failed: ")[2] == cause else first  # the same error everywhere: no news

    def fail(self, cause: str) -> Optional[str]:
        """This rank fails because of ``cause``: tell the others (``abort``), and return what more likely
        explains it: a rank that failed first for another cause, or a peer that is gone; else None."""
        if self._ending.locked():  # the thread is ending this process, for a reason it has printed: the
            time.sleep(2 * self.stale_after)  # main thread's error (a peer gone meanwhile) is a consequence
        first = self.abort(cause)
        if first is not None:
            return first
        try:
            return self._gone_peer() or self._dead_local_peer(grace=0.5)
        except Exception as error:  # noqa: BLE001
            return self._store_lost(error)

    # -- the thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        beats = 0
        while not self._stopping.wait(self.interval):
            beats += 1
            try:
                mine = encode(beats, LOG.snapshot())  # [Note: finding collectives that cannot complete]
                self._store.set(self._key(f"hb/{self.rank}"), mine)
                self._values[self.rank] = mine.encode()
                reason = None if self._aborted_here else (self._abort_message() or self._gone_peer())
                hang = None
                if reason is None and not self._aborted_here and self._hangs is not None:
                    hang = self._find_hang()
                    if hang is not None:
                        reason = self._declare(hang)
            except Exception as error:  # noqa: BLE001
                if self._stopping.is_set():
                    return
                reason = self._store_lost(error)
            if reason is not None and not self._stopping.is_set() and not self._aborted_here:
                terminated = TERMINATED in reason
                shared = terminated or HANG in reason  # every rank ends for this one reason
                self._end(reason, TERMINATED_EXIT_CODE if terminated else EXIT_CODE, shared=shared)

    def _abort_message(self) -> Optional[str]:
        if not self._store.check([self._key("abort")]):
            return None
        return f"{self._store.get(self._key('abort')).decode()} (reported through the rendezvous store)"

    def _find_hang(self) -> Optional[str]:
        """The message ending every rank when this rank's collective can never complete (hang_check.py)."""
        assert self._hangs is not None
        now = time.monotonic()
        if self.world_size > POLL_ALL and self._hangs.stuck_for(self.rank, now) >= self._hangs.timeout:
            for rank in range(self.world_size):  # [Note: who reads whose record]: only while stuck
                if rank not in self._polled and rank != self.rank:
                    key = self._key(f"hb/{rank}")
                    if self._store.check([key]):
                        self._values[rank] = self._store.get(key)
        texts, records = {}, {}
        for rank, value in self._values.items():
            decoded = decode(value)
            if decoded is not None:
                texts[rank], records[rank] = decoded
        if self.rank not in records:
            return None
        self._hangs.observe(texts, records, now)
        return self._hangs.verdict(records, now)

    def _declare(self, message: str) -> str:
        """Publish ``message`` as the abort (the first abort wins); return what this rank prints."""
        first = self._store.compare_set(self._key("abort"), "", message).decode()
        return message if first == message else f"{first} (reported through the rendezvous store)"

    def terminate(self) -> None:
        """This process received SIGTERM (from the termination watch's thread): tell every rank, end."""
        self._aborted_here = True
        mine = f"rank {self.rank} {TERMINATED} (from the job scheduler, `timeout` or `kill`)"
        try:
            self._store.compare_set(self._key("abort"), "", mine)
        except Exception:  # noqa: BLE001 - no store: the peers see this process go instead
            pass
        self._end(mine.replace(f"rank {self.rank} ", "this rank ", 1), TERMINATED_EXIT_CODE, shared=True)

    def _gone_peer(self) -> Optional[str]:
        now = time.monotonic()
        for peer in self._polled:
            state = self._peer_state(peer, now)
            if state not in ("running", "done"):
                return state
        return None

    def _finished(self, peer: int) -> bool:
        """Whether ``peer`` said it is done, or that it ends because of an abort (False without a store)."""
        try:
            return any(self._store.check([self._key(f"{what}/{peer}")]) for what in ("done", "seen"))
        except Exception:  # noqa: BLE001
            return False

    def _peer_state(self, peer: int, now: float) -> str:
        """"done" (finished, or saw an abort), "running", or why it is gone."""
        if self._finished(peer):
            return "done"
        if peer not in self._where and self._store.check([self._key(f"where/{peer}")]):
            host, pid = self._store.get(self._key(f"where/{peer}")).decode().split()
            self._where[peer] = (host, int(pid))
        host, pid = self._where.get(peer, ("?", -1))
        if host == self.host and pid > 0 and not process_alive(pid):
            return f"rank {peer} (process {pid} on this host) ended without a word: killed (SIGKILL, out of memory?)"
        if not self._store.check([self._key(f"hb/{peer}")]):
            if now - self._started > self.stale_after:
                return f"rank {peer} never started its heartbeat in {self.stale_after:.0f} s"
            return "running"
        beat = self._values[peer] = self._store.get(self._key(f"hb/{peer}"))
        last, since = self._seen.get(peer, (None, now))
        if beat != last:
            self._seen[peer] = (beat, now)
        elif now - since > self.stale_after:
            return f"rank {peer} (on {host}) sent no heartbeat for {now - since:.0f} s: killed, frozen or cut off"
        return "running"

    def _dead_local_peer(self, grace: float) -> Optional[str]:
        """A peer of this host whose process is gone, looking again for ``grace`` seconds: a killed process
        closes its sockets (which is how this rank learns something is wrong) a moment before the kernel
        marks it dead."""
        local = [(peer, pid) for peer, (host, pid) in self._where.items() if host == self.host]
        deadline = time.monotonic() + (grace if local else 0.0)
        while True:
            for peer, pid in local:
                if not process_alive(pid) and not self._finished(peer):
                    return f"rank {peer} (process {pid} on this host) ended without a word: killed (SIGKILL, out of memory?)"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _store_lost(self, error: BaseException) -> str:
        found = self._dead_local_peer(grace=0.5)  # a peer of this host that is gone says more
        if found is not None:
            return found
        return (
            f"lost the rendezvous store ({type(error).__name__}: {_one_line(str(error))}); it lives in rank 0's "
            "process under Lightning's launcher (in the launcher's under torchrun), which is gone"
        )

    def _end(self, reason: str, code: int = EXIT_CODE, shared: bool = False) -> None:
        if not self._ending.acquire(blocking=False):  # the other thread (watch or heartbeat) is ending it
            return
        print(f"zero3: rank {self.rank} stops because {reason}.", file=sys.stderr, flush=True)
        if shared:  # peers exit from now on, and this rank's main thread may fail in its collective: a
            _silence_stderr()  # consequence, whose traceback would only bury the message above
        try:
            self._store.set(self._key(f"seen/{self.rank}"), "1")
            # rank 0: the store lives as long as it is needed. When every rank ends for one reason (a hang,
            # SIGTERM), every rank waits for its peers to have seen it: a peer's collective fails ("Connection
            # closed by peer") once this process is gone, and that peer should end with this message, not that
            # error. Then the others say they are done with the store ("left"), and rank 0 goes last.
            limit = min(self.stale_after, 5.0)
            self._wait_for_peers(limit, every_rank=shared)
            if shared and self.rank != 0:
                self._store.set(self._key(f"left/{self.rank}"), "1")
            elif shared:
                deadline = time.monotonic() + limit
                while time.monotonic() < deadline and not all(
                    self._store.check([self._key(f"left/{peer}")])
                    or self._peer_state(peer, time.monotonic()) not in ("running", "done")  # gone
                    for peer in self._peers
                ):
                    time.sleep(0.05)
        except Exception:  # noqa: BLE001 - the store is gone
            pass
        for cleanup in self._cleanups:
            try:
                cleanup()
            except Exception:  # noqa: BLE001 - ending anyway
                pass
        self.exit(code)


def _silence_stderr() -> None:
    """Send whatever this process still writes to stderr to /dev/null (it is about to end)."""
    try:
        sys.stderr.flush()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        os.close(null)
    except (OSError, ValueError):
        pass


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."
