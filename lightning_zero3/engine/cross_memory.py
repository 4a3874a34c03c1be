"""Two ranks of one host swap buffers by reading each other's memory.

[Note: a pair reads across processes]
On one host, gloo moves a swap's bytes through the TCP loopback: the sender's kernel copies them into a
socket, the receiver's copies them out, and gloo's loop threads wake for every message. For a 4.8 MB
half of a block of the benchmark GPT on the 2-core hosts of the README that is 2-3 ms of CPU per swap
on the cores the compute needs. Linux's cross-memory attach (``process_vm_readv``, what MPI libraries
use for large messages inside one node) copies straight from another process's memory into this one's:
one copy, 0.34 ms for the same 4.8 MB there. A swap over a ``PairChannel``:

- ``swap`` (the caller's thread) sends the peer where its outgoing bytes are (address and length, 16
  bytes on the pair's gloo group) and posts the receives of the peer's address and of its "read" note;
- the channel's reader thread takes swaps in issue order: it waits for the peer's address, copies the
  peer's bytes into the receiving tensor with ``process_vm_readv``, sends the peer the "read" note
  (then the peer may reuse the buffer it sent), and waits for the peer's note before the next swap;
- ``wait`` returns once this rank's copy is done and the peer's note has come: both buffers are free.

[Note: a fixed shard is read without messages]
A shard that lives in its gathered buffer (see [Note: the shard lives in its gathered buffer] in
shard.py) stays at one address for the group's life and changes only in the optimizer step (and in
collectives such as a checkpoint load, which both ranks enter). Every gather is agreed on by both ranks
before it is issued (agreement.py), so when it is issued the peer is past the step that wrote its shard;
and the peer's next step needs this rank's reductions, which come after every gather this rank waits
for. So the address travels once, with the first swap of that shard (a ``PeerShard`` the group keeps,
filled by the reader thread), and later gathers of the unit are a read alone: no address, no "read"
note, no gloo message or loop-thread wake-up on either rank (three messages per gather before). Both
ranks decide alike at issue time (``PeerShard.announced``, set by the first swap), never from what their
reader threads have done, so the two never disagree about whether a message comes.

The copy runs on a thread of its own because a rank's waits follow its own program, which differs
between ranks: gathers and reductions interleave differently (see [Note: three process groups] in
comm.py). A rank that read only inside ``wait`` could block there for a note that the peer sends only
from a ``wait`` of its own that comes after a gather this rank has not issued yet. The reader thread,
like gloo's own threads, moves every swap as soon as both ranks have issued it. One channel serves one
kind of collective on one group, whose swaps both ranks issue in the same order ([Note: swap tags] in
comm.py); its tags lie above those of gloo's swaps, so the two ways can be in flight together.

Reading another process's memory needs the kernel's ptrace permission over it. A process may always
read its own user's processes unless Yama's ``ptrace_scope`` is 1 (Ubuntu's default), which allows only
descendants: there each rank names its peer (``prctl(PR_SET_PTRACER, peer)``, that one process of the
same user; cleared again when the channel closes). ``open_pair`` checks that each rank can read the
other, by a random token each writes into memory of its own and the other must read back; in another
container, on another host, or where the system refuses (seccomp, ``ptrace_scope`` 2 or 3) the check
fails on some rank, every rank learns so, and the pair keeps gloo's ways.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .libc import LIBC as _LIBC

#: where a channel's tags start: above gloo's swaps' (which stay below 1 << 30, see comm.py)
TAG_BASE = 1 << 30
_PR_SET_PTRACER = 0x59616D61
_YAMA_SCOPE = Path("/proc/sys/kernel/yama/ptrace_scope")


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


_read_across = getattr(_LIBC, "process_vm_readv", None)
if _read_across is not None:
    _read_across.restype = ctypes.c_ssize_t
    _read_across.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                             ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]  # fmt: skip


class CrossMemoryError(RuntimeError):
    """A read from the peer's memory failed during training."""


def read_peer(pid: int, into: torch.Tensor, address: int) -> None:
    """Copy ``into.nbytes`` bytes at ``address`` in process ``pid`` into the host tensor ``into``
    (contiguous); ctypes lets go of the GIL for the copy."""
    done, total = 0, into.nbytes
    while done < total:  # the kernel may copy less than asked (a partial read): go on from there
        local = _IoVec(into.data_ptr() + done, total - done)
        remote = _IoVec(address + done, total - done)
        got = _read_across(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got <= 0:
            error = ctypes.get_errno()
            raise CrossMemoryError(f"zero3: reading {total} bytes from rank process {pid} failed: {os.strerror(error)}")
        done += got


class PeerShard:
    """Where the other rank's fixed shard of one group is (see [Note: a fixed shard is read without
    messages]): ``announced`` once a swap carrying its address was issued; the address and length once
    the reader thread has received them."""

    def __init__(self) -> None:
        self.announced = False
        self.address: Optional[int] = None
        self.length = 0


class _Copy:
    """A copy of the peer's bytes into ``receive`` in flight: ``done`` is set by the reader thread once it
    is over (with ``error`` if it failed); ``peer_shard``: where the peer's fixed shard is, if it is one."""

    def __init__(self, receive: torch.Tensor, peer_shard: Optional[PeerShard]) -> None:
        self.receive, self.peer_shard = receive, peer_shard
        self.done = torch.futures.Future()
        self.error: Optional[BaseException] = None

    def is_completed(self) -> bool:
        return self.done.done()

    def wait(self) -> None:
        self.done.wait()
        if self.error is not None:
            raise self.error

    def get_future(self) -> Any:
        return self.done  # the communicator's clock stamps the completion on it


class _Read(_Copy):
    """A read of the peer's fixed shard, without messages: done once the copy is."""


class _Swap(_Copy):
    """One swap in flight: done once this rank has read the peer's bytes and the peer has read ours."""

    def __init__(self, send: torch.Tensor, receive: torch.Tensor, tag: int, peer: int, group: Any,
                 peer_shard: Optional[PeerShard] = None) -> None:  # fmt: skip
        # ``peer_shard``: where the reader records the peer's address (a fixed shard's first swap)
        super().__init__(receive, peer_shard)
        self.send, self.tag = send, tag  # ``send`` alive until the peer has read it
        # the tensors of the three messages: this rank's address and length, the peer's, the peer's note
        self.mine = torch.tensor([send.data_ptr(), send.nbytes], dtype=torch.int64)
        self.peer_address = torch.empty(2, dtype=torch.int64)
        self.peer_note = torch.empty(1, dtype=torch.int64)
        # each gloo work is waited for once, by one thread: a second wait of a receive waits for another
        # message. ``sent`` by the caller's ``wait``; the two receives by the reader thread.
        self.sent = dist.isend(self.mine, peer, group, tag)
        self.address_come = dist.irecv(self.peer_address, peer, group, tag)
        self.peer_read = dist.irecv(self.peer_note, peer, group, tag + 1)
        self._waited = False

    def wait(self) -> None:
        if self._waited:
            return
        super().wait()
        self.sent.wait()
        self._waited = True


class PairChannel:
    """Swaps with the other rank of a two-rank group by reading its memory (one kind of collective, one
    group: see [Note: a pair reads across processes])."""

    def __init__(self, group: Any, peer: int, peer_pid: int, name: str) -> None:
        self.group, self.peer, self.peer_pid, self.name = group, peer, peer_pid, name
        self._swaps: "queue.Queue[Optional[_Copy]]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None

    def swap(self, send: torch.Tensor, receive: torch.Tensor, tag: int, peer_shard: Optional[PeerShard] = None) -> _Copy:
        """Start swapping ``send`` (this rank's bytes) for the peer's into ``receive``; both contiguous
        host tensors of the same size. ``tag``: the swap's number, counted alike on both ranks.
        ``peer_shard``: ``send`` is a fixed shard and this is where the peer's is: after the first swap,
        a read alone (see [Note: a fixed shard is read without messages])."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._read_swaps, name=f"zero3-read-{self.name}", daemon=True)
            self._thread.start()
        if peer_shard is not None and peer_shard.announced:
            pending: _Copy = _Read(receive, peer_shard)
        else:
            pending = _Swap(send, receive, TAG_BASE + 2 * (tag % (1 << 28)), self.peer, self.group, peer_shard)
            if peer_shard is not None:
                peer_shard.announced = True
        self._swaps.put(pending)
        return pending

    def _read_swaps(self) -> None:
        note = torch.ones(1, dtype=torch.int64)
        while True:
            pending = self._swaps.get()
            if pending is None:
                return
            try:
                self._read(pending, note)
            except BaseException as error:  # handed to the waiting thread, which raises it
                pending.error = error
            pending.done.set_result(None)

    def _read(self, pending: _Copy, note: torch.Tensor) -> None:
        if isinstance(pending, _Read):  # the peer's fixed shard, where its first swap said it is
            peer_shard = pending.peer_shard
            if peer_shard.address is None:
                raise CrossMemoryError("zero3: the first swap of this shard with the other rank failed; no address to read")
            _check_sizes(pending.receive.nbytes, peer_shard.length)
            read_peer(self.peer_pid, pending.receive, peer_shard.address)
            return
        pending.address_come.wait()
        address, length = pending.peer_address.tolist()
        _check_sizes(pending.receive.nbytes, length)
        if pending.peer_shard is not None:
            pending.peer_shard.address, pending.peer_shard.length = address, length
        read_peer(self.peer_pid, pending.receive, address)
        told = dist.isend(note, self.peer, self.group, pending.tag + 1)
        # the peer reads this swap as soon as it has our address, whatever else it waits for: waiting
        # for its note here holds up only this channel's next swap, which needs the peer anyway
        pending.peer_read.wait()
        told.wait()

    def close(self) -> None:
        """Stop the reader thread (every swap must have been waited for)."""
        if self._thread is not None:
            self._swaps.put(None)
            self._thread.join(timeout=5.0)
            self._thread = None


def _check_sizes(wanted: int, length: int) -> None:
    if length != wanted:
        raise CrossMemoryError(
            f"zero3: the ranks of the pair swap different sizes ({wanted} bytes here, {length} on the other "
            "rank): their collectives are out of step."
        )


def _yama_scope() -> Optional[int]:
    try:
        return int(_YAMA_SCOPE.read_text().strip())
    except (OSError, ValueError):
        return None


def _allow_tracer(pid: int) -> None:
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PTRACER, ctypes.c_ulong(pid), 0, 0, 0)


def open_pair(gather_objects: Callable[[Any], list], rank: int) -> Optional[int]:
    """Whether this rank and the other of a two-rank group can read each other's memory: the peer's pid
    if both can, else None, alike on both ranks (a collective: ``gather_objects`` gathers a small object
    from both ranks in rank order). See [Note: a pair reads across processes]."""
    if _read_across is None:
        gather_objects(None)  # the peer still calls: the same collectives on both ranks
        return None
    token = int.from_bytes(os.urandom(8), "little") >> 1
    probe = torch.tensor([token], dtype=torch.int64)
    mine = (os.getpid(), probe.data_ptr(), token)
    everyone = gather_objects(mine)
    if any(entry is None for entry in everyone):
        return None
    peer_pid, peer_address, peer_token = everyone[1 - rank]
    if _yama_scope() == 1:
        _allow_tracer(peer_pid)
    got = torch.zeros(1, dtype=torch.int64)
    try:
        read_peer(peer_pid, got, peer_address)
        ok = int(got) == peer_token
    except CrossMemoryError:
        ok = False
    both = gather_objects(ok)  # ``probe`` stays alive until the peer has read it
    if not all(both):
        if _yama_scope() == 1:
            _allow_tracer(0)
        return None
    return peer_pid


def close_pair() -> None:
    """Undo what ``open_pair`` changed in this process (the named tracer, where Yama asked for one)."""
    if _yama_scope() == 1:
        _allow_tracer(0)
