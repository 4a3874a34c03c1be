"""Large buffers and the byte ledger.

Every large tensor the engine holds is allocated here, and every gathered buffer is released and
reclaimed here, so the ledger knows at each moment how many bytes the engine holds by category, and
the highest total it has held since it was created. Tests cross-check the ledger against the real
tensors (``resident_bytes`` asks the kernel which pages are really there).

[Note: releasing gathered buffers]
A gathered parameter is a view into its unit's flat ``full`` buffer. Users, optimizers and autograd hold
those views, so the buffer object must outlive every release: it is emptied and refilled in place.
- On CUDA the storage is resized to zero bytes and back (``storage.resize_``), as torch FSDP does; the
  caching allocator reuses the blocks.
- On the host a resize goes through malloc, and glibc keeps freed multi-MB blocks in its heap (its mmap
  threshold adapts upward to the sizes it sees freed), so the process's resident set grows past what the
  engine holds and stays there. So a host buffer that is released and reclaimed again and again is a
  private anonymous memory map of its own: releasing it is ``madvise(MADV_DONTNEED)``, which hands its
  pages back to the kernel at once; the next write faults fresh zero pages in. Transparent huge pages are
  requested for it (``MADV_HUGEPAGE``), which makes that refill several times faster than malloc's resize.
  The mapping lives as long as the tensor (and its views).

[Note: huge pages stay inside their buffer]
The kernel merges neighbouring anonymous mappings with the same settings into one region, and a huge
page fault fills a whole 2 MiB block of that region: writing one buffer would then bring in zeroed pages
of its released neighbours, and the resident set would exceed the ledger. Each mapping therefore ends
in a guard page with the opposite huge-page setting, so no two buffers share a region and a huge page
only ever covers pages of the buffer being written.

[Note: buffers start on a huge-page boundary]
A huge page can only map an aligned 2 MiB block, and the kernel places a mapping on any page boundary:
a buffer that started 1.3 MiB past one had its first and last blocks in small pages. Worse, moving
pages between two buffers (``mremap``, see [Note: released pages are parked] in parking.py) keeps a
huge page only when both buffers sit at the same offset from a 2 MiB boundary; otherwise the kernel
splits it into small pages, and the gathered weights computed on from then on miss the TLB more
(a decode-sized matmul runs measurably slower on moved, split pages). So a buffer of
2 MiB or more is mapped with 2 MiB of slack in front and starts at the first 2 MiB boundary inside its
map; the slack is never touched (address space only, no memory).

[Note: shards are in small pages]
A huge page is zeroed by the kernel whole when first touched, and in a virtual machine memory the guest
has not used lately costs host work on its first touch as well: writing freshly loaded shards into huge
pages is dominated by the kernel's page clearing. A unit's shard without offload is written once (initialised or
loaded) and then read by each all-gather in one sequential pass, where huge pages buy nothing
measurable, so it is mapped in small pages. Buffers that are released and refilled again and again
(gathered units, offload's all-gather sources) keep huge pages: refilled warm, they fault in faster.

[Note: reused staging buffers]
Buffers that exist only for a moment but recur every step at the same sizes (a unit's packed gradients,
reduce-scatter outputs, the landing buffer of a coalesced all-gather, host staging of offload) come from
a ``BufferPool``: given back after use, taken again by the next user of that size. Their pages stay
resident and the ledger counts them, in use or idle, so the resident set is what the ledger says: the
most that was in use at once, plus what an earlier phase left idle (``trim`` hands that back).
"""

from __future__ import annotations

import ctypes
import mmap
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional

import torch

from . import parking
from .libc import LIBC as _LIBC

# Categories of bytes that the engine holds.
PARAM_SHARDS = "param_shards"  # this rank's 1/N of every sharded parameter (the optimizer's parameters)
GRAD_SHARDS = "grad_shards"  # this rank's 1/N of every gradient, in the shard dtype
OPTIMIZER_STATE = "optimizer_state"  # the optimizers' state tensors in memory (Adam's moments, ...)
PERSISTENT_PARAMS = "persistent_params"  # whole copies of the small parameters every rank keeps
GATHERED_PARAMS = "gathered_params"  # full parameters of units gathered right now
SECONDARY_SHARDS = "secondary_shards"  # node-local copies kept from forward for backward (see shard/secondary.py)
STAGING = "staging_buffers"  # reused transient buffers: packed gradients, collective landing zones
OFFLOAD_HOST = "offload_host"  # host-memory tier of offload: master / gradient shards, staging buffers
OFFLOAD_NVME = "offload_nvme"  # bytes of swap files on the NVMe tier (on disk, not in memory)
CATEGORIES = (
    PARAM_SHARDS, GRAD_SHARDS, OPTIMIZER_STATE, PERSISTENT_PARAMS, GATHERED_PARAMS, SECONDARY_SHARDS, STAGING,
    OFFLOAD_HOST, OFFLOAD_NVME,
)  # fmt: skip
HUGE_PAGE = 2 << 20  # a transparent huge page (x86-64, arm64 with 4 KiB pages)


@dataclass
class ByteLedger:
    """Bytes held per category on this rank, and the peaks since the ledger was created.

    ``peak`` is per category; ``peak_total`` is the highest sum of the in-memory categories at any
    moment (what the engine itself adds to the process's resident set at its worst)."""

    held: dict = field(default_factory=lambda: {c: 0 for c in CATEGORIES})
    peak: dict = field(default_factory=lambda: {c: 0 for c in CATEGORIES})
    total: int = 0
    peak_total: int = 0
    watchers: list = field(default_factory=list)  # per-category peaks of the phases being watched
    # gathered parameters plus staging buffers at their highest outside evaluation: what a training step
    # needs on top of the shards (the automatic inference budget is held to it, see schedule/residency.py)
    peak_training_transient: int = 0
    evaluating: bool = False

    def add(self, category: str, nbytes: int) -> None:
        self.held[category] += nbytes
        self.peak[category] = max(self.peak[category], self.held[category])
        for watched in self.watchers:
            watched[category] = max(watched[category], self.held[category])
        if category in (GATHERED_PARAMS, STAGING) and not self.evaluating:
            transient = self.held[GATHERED_PARAMS] + self.held[STAGING]
            self.peak_training_transient = max(self.peak_training_transient, transient)
        if category != OFFLOAD_NVME:
            self.total += nbytes
            self.peak_total = max(self.peak_total, self.total)

    def remove(self, category: str, nbytes: int) -> None:
        self.held[category] -= nbytes
        assert self.held[category] >= 0, f"byte ledger went negative for {category}"
        if category != OFFLOAD_NVME:
            self.total -= nbytes

    def set(self, category: str, nbytes: int) -> None:
        """Record that ``category`` now holds ``nbytes`` (for memory the engine observes, not allocates)."""
        change = nbytes - self.held[category]
        if change > 0:
            self.add(category, change)
        elif change < 0:
            self.remove(category, -change)

    @contextmanager
    def watch(self) -> Iterator[dict]:
        """Per-category peaks while the block runs (a phase of the run: a save, a clipping pass, ...)."""
        watched = dict(self.held)
        self.watchers.append(watched)
        try:
            yield watched
        finally:
            self.watchers.remove(watched)

    @property
    def peak_gathered(self) -> int:
        return self.peak[GATHERED_PARAMS]


def _nbytes(numel: int, dtype: torch.dtype) -> int:
    return numel * torch.empty((), dtype=dtype).element_size()


def new_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat zero-filled buffer. Created outside inference mode, so later training may write to it. On the
    host it is a memory map of its own, whose pages the kernel zero-fills on their first write: a gradient
    shard costs no memory until backward writes it (zeroing it up front would cost a large share of a
    load's time, and a frozen unit's pages are never written)."""
    if torch.device(device).type == "cpu":
        return _mapped(numel, dtype)
    with torch.inference_mode(False):
        return torch.zeros(numel, dtype=dtype, device=device)


def host_buffer(numel: int, dtype: torch.dtype, pin: bool = False) -> torch.Tensor:
    """An uninitialised flat host buffer; page-locked when ``pin`` (asynchronous copies to CUDA), else a
    memory map of its own (see [Note: releasing gathered buffers]): freed to the kernel when dropped."""
    if pin:
        with torch.inference_mode(False):
            return torch.empty(numel, dtype=dtype, pin_memory=True)
    return _mapped(numel, dtype)


def _mapped(numel: int, dtype: torch.dtype, huge: bool = True) -> torch.Tensor:
    """A zero-filled host tensor over a private anonymous mapping of its own; in transparent huge pages
    unless ``huge=False`` (see [Note: shards are in small pages])."""
    nbytes = _nbytes(numel, dtype)
    if nbytes == 0:
        return torch.zeros(0, dtype=dtype)
    length = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    slack = HUGE_PAGE if length >= HUGE_PAGE and huge else 0  # see [Note: buffers start on a huge-page boundary]
    # one guard page past the end, never touched: see [Note: huge pages stay inside their buffer]
    region = mmap.mmap(-1, slack + length + mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    offset = -parking.address(region) % HUGE_PAGE if slack else 0
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            if not huge:
                region.madvise(mmap.MADV_NOHUGEPAGE, 0, len(region))
            else:
                if offset:
                    region.madvise(mmap.MADV_NOHUGEPAGE, 0, offset)
                region.madvise(mmap.MADV_HUGEPAGE, offset, length)
                region.madvise(mmap.MADV_NOHUGEPAGE, offset + length, len(region) - offset - length)
        except OSError:  # a kernel without transparent huge pages: ordinary pages
            pass
    with torch.inference_mode(False):  # a storage of exactly the tensor's bytes (not the page-rounded map)
        tensor = torch.frombuffer(memoryview(region)[offset : offset + nbytes], dtype=dtype, count=numel)
    tensor._zero3_region = region  # released with madvise; unmapped when the tensor and its views go
    tensor._zero3_span = (offset, length)  # where in the map the buffer's pages are
    return tensor


def releasable_buffer(numel: int, dtype: torch.dtype, device: torch.device, huge: bool = True) -> torch.Tensor:
    """A flat zero-filled buffer that is released and reclaimed in place (see [Note: releasing gathered
    buffers]): a memory map of its own on the host (``huge``: in transparent huge pages), an ordinary
    tensor on an accelerator."""
    if device.type == "cpu":
        return _mapped(numel, dtype, huge)
    return new_buffer(numel, dtype, device)


MADV_POPULATE_WRITE = 23  # Linux 5.14


def populate(tensor: torch.Tensor) -> None:
    """Fault in the pages under a host ``tensor`` that is about to be written whole, in one call: the
    kernel maps them in bulk instead of one fault per page as the writes reach them. Contents are
    unchanged; a no-op on kernels
    without it and for accelerator tensors."""
    if tensor.device.type != "cpu" or _LIBC is None or tensor.numel() == 0:
        return
    start = -(-tensor.data_ptr() // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > start:
        _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_POPULATE_WRITE)


def release(tensor: torch.Tensor, ledger: Optional[ByteLedger] = None) -> None:
    """Give the memory of ``tensor`` back; the tensor (and its views) survive, contents undefined. With a
    ``ledger``, a host map's pages are parked for the next reclaim of the same size instead, counted there
    as staging bytes until taken (see [Note: released pages are parked] in parking.py)."""
    region = getattr(tensor, "_zero3_region", None)
    if region is not None:
        offset, length = tensor._zero3_span
        tensor._zero3_released = True
        if ledger is not None and parking.can_park():
            ledger.add(STAGING, length)
            parking.park(region, offset, length, lambda: ledger.remove(STAGING, length))
        elif not parking.holds(region):
            region.madvise(mmap.MADV_DONTNEED, offset, length)
        return
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


def reclaim(tensor: torch.Tensor) -> None:
    """Make a released ``tensor`` usable again (contents undefined until written): a host map takes the
    parked pages if they fit it, else its pages fault in on the first write."""
    region = getattr(tensor, "_zero3_region", None)
    if region is not None:
        if getattr(tensor, "_zero3_released", False):
            parking.take(region, *tensor._zero3_span)
            tensor._zero3_released = False
        return
    storage = tensor.untyped_storage()
    nbytes = tensor.numel() * tensor.element_size()
    if storage.size() != nbytes:
        storage.resize_(nbytes)


# -- what the kernel really holds ------------------------------------------------------------------

_PAGE = mmap.PAGESIZE


def resident_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the pages under ``tensor``'s storage that are resident in memory right now (``mincore``).

    A measurement, not bookkeeping: tests use it to check that released buffers really left memory.
    CUDA tensors report their storage size."""
    storage = tensor.untyped_storage()
    if tensor.device.type != "cpu":
        return storage.size()
    if storage.size() == 0 or _LIBC is None:
        return 0
    start = storage.data_ptr() // _PAGE * _PAGE
    end = storage.data_ptr() + storage.size()
    pages = -(-(end - start) // _PAGE)
    vector = (ctypes.c_ubyte * pages)()
    if _LIBC.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), vector) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(1 for v in vector if v & 1) * _PAGE


def drop_pages(tensor: torch.Tensor) -> None:
    """Hand the pages under ``tensor`` back to the kernel when they are a private mapping of a file
    (``torch.load(..., mmap=True)``, only ever read): read once, they need not stay resident, and are read
    from the file again if touched. Other tensors are left as they are (dropping pages of ordinary memory
    would lose their contents)."""
    storage = tensor.untyped_storage()
    if tensor.device.type != "cpu" or _LIBC is None or storage.size() == 0 or not _is_file_mapped(storage):
        return
    start = storage.data_ptr() // _PAGE * _PAGE
    end = -(-(storage.data_ptr() + storage.size()) // _PAGE) * _PAGE
    _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 4)  # MADV_DONTNEED


def _is_file_mapped(storage: torch.UntypedStorage) -> bool:
    """Whether ``storage`` lies in a file mapping (per /proc/self/maps), the only memory ``drop_pages`` may drop."""
    address = storage.data_ptr()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                span, _, rest = line.partition(" ")
                low, high = (int(x, 16) for x in span.split("-"))
                if low <= address < high:
                    fields = rest.split()
                    # a private mapping of a file (``mmap=True`` maps copy-on-write): clean pages re-read on use
                    return len(fields) >= 5 and fields[4].startswith("/") and fields[0].endswith("p")
    except OSError:
        return False
    return False


class BufferPool:
    """Transient buffers reused by size (see [Note: reused staging buffers]), counted under ``category``.

    ``take`` returns a buffer of exactly ``numel`` elements (zeroed when asked), ``give`` takes it back.
    ``keep_bytes`` bounds what idle buffers may hold: beyond it a returned buffer is dropped (and, being
    a mapping of its own, goes back to the kernel at once)."""

    def __init__(self, ledger: ByteLedger, category: str = STAGING, pin: bool = False, keep_bytes: Optional[int] = None) -> None:
        self.ledger = ledger
        self.category = category
        self.pin = pin
        self.keep_bytes = keep_bytes
        self.idle: dict[tuple, list[torch.Tensor]] = {}
        self.idle_bytes = 0

    @staticmethod
    def _key(numel: int, dtype: torch.dtype, device: torch.device) -> tuple:
        return (numel, dtype, torch.device(device))

    def take(self, numel: int, dtype: torch.dtype, device: torch.device = torch.device("cpu"), zero: bool = False) -> torch.Tensor:
        free = self.idle.get(self._key(numel, dtype, device))
        if free:
            buffer = free.pop()
            self.idle_bytes -= buffer.numel() * buffer.element_size()
            return buffer.zero_() if zero else buffer
        device = torch.device(device)
        if device.type == "cpu":
            buffer = host_buffer(numel, dtype, pin=self.pin)  # fresh mappings are zero-filled
            if zero and self.pin:
                buffer.zero_()
        else:
            with torch.inference_mode(False):
                buffer = (torch.zeros if zero else torch.empty)(numel, dtype=dtype, device=device)
        self.ledger.add(self.category, buffer.numel() * buffer.element_size())
        return buffer

    def give(self, buffer: torch.Tensor) -> None:
        nbytes = buffer.numel() * buffer.element_size()
        if self.keep_bytes is not None and self.idle_bytes + nbytes > self.keep_bytes:
            self.ledger.remove(self.category, nbytes)
            return
        self.idle.setdefault(self._key(buffer.numel(), buffer.dtype, buffer.device), []).append(buffer)
        self.idle_bytes += nbytes

    def trim(self) -> None:
        """Drop every idle buffer (their memory goes back to the kernel)."""
        for buffers in self.idle.values():
            for buffer in buffers:
                self.ledger.remove(self.category, buffer.numel() * buffer.element_size())
        self.idle = {}
        self.idle_bytes = 0


M_MMAP_THRESHOLD = -3  # mallopt's parameter number in glibc's malloc.h
HEAP_MMAP_THRESHOLD = 4 << 20  # host temporaries at or above this size are maps of their own


def map_large_temporaries() -> None:
    """Fix glibc's mmap threshold at ``HEAP_MMAP_THRESHOLD`` for this process, unless the user set
    ``MALLOC_MMAP_THRESHOLD_`` (then theirs stands). Called by engines that train on the host with
    offload (where host memory is what the run is sized by).

    [Note: large temporaries are mapped]
    glibc serves an allocation at or above its mmap threshold (128 KiB at start) with a map of its own,
    unmapped when freed; but it raises the threshold to the size of every mapped block that is freed (up
    to 32 MiB). Autograd computes each weight's gradient into a new tensor, adds it into the unit's
    landing buffer (see [Note: gradients land in a pooled buffer] in engine/shard/flat_group.py) and frees it: after the
    first such multi-MB block is freed, the later ones come from the heap, and the heap holds their freed
    space resident: most of the heap a backward leaves behind is free, yet counts in the process's peak.
    ``mallopt`` fixes the threshold (and turns off its adjustment), so every host temporary of 4 MiB or
    more is a map that goes back to the kernel when it is freed; smaller ones use the heap. The setting is
    process-wide: the user's own large host tensors are mapped too (they fault fresh pages in on first use
    instead of reusing heap pages). That costs compute time where activations are large, so only engines
    that offload to host memory or NVMe (the runs sized by their host memory) set it; others keep glibc's
    default."""
    if _LIBC is None or not hasattr(_LIBC, "mallopt") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    _LIBC.mallopt(M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD)


M_TRIM_THRESHOLD, M_TOP_PAD = -1, -2  # mallopt's parameter numbers in glibc's malloc.h
HEAP_MMAP_CEILING = 32 << 20  # glibc's adaptive ceilings on 64-bit: mmap threshold 32 MiB, trim threshold twice it
HEAP_TRIM_CEILING = 64 << 20
HEAP_TOP_PAD = 64 << 20  # what a trim of the heap's top leaves in place
#: the environment variables by which a user sets glibc's heap policy; any of them leaves it to the user
ALLOCATOR_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def keep_heap_top() -> None:
    """Fix glibc's mmap and trim thresholds at the ceilings its own adaptation may reach (32 and 64 MiB)
    and keep 64 MiB in place when it trims, unless the user set any of ``ALLOCATOR_VARIABLES``. Called by
    engines that train on the host without offload.

    [Note: the heap keeps its top between steps]
    glibc gives the free top of its heap back to the kernel whenever it grows past the trim threshold,
    which it adapts to twice the largest mapped block freed so far. Under DDP the gradients autograd makes in backward live on
    until the next step's ``zero_grad`` and pin the heap. Under zero3 each gradient is added into its
    unit's landing buffer and freed at once, so as backward frees the last layers' activations the top
    of the heap grows past the threshold, is trimmed, and the next allocations fault fresh pages in, each
    zeroed by the kernel: thousands of page faults per step in the compute thread, where DDP's has none.
    With both thresholds fixed at the ceilings (``mallopt``; setting either turns glibc's adaptation off,
    so both are set) a step faults almost nothing, except where the heap's layout (allocation order
    differs from run to run) still leaves more than the trim threshold free at its top; a trim that leaves
    64 MiB in place (``M_TOP_PAD``) covers that too, at a slightly higher peak. Never trimming also removes
    the faults, but then what backward allocates outside the heap (the gradient shards' first pages)
    stacks on the heap's whole high-water mark, a higher peak still. Engines that offload map their large
    temporaries instead and trim after every step ([Note: large temporaries are mapped]); on an
    accelerator the host heap is not where training's memory is, and it is left alone."""
    if _LIBC is None or not hasattr(_LIBC, "mallopt") or any(name in os.environ for name in ALLOCATOR_VARIABLES):
        return
    _LIBC.mallopt(M_MMAP_THRESHOLD, HEAP_MMAP_CEILING)
    _LIBC.mallopt(M_TRIM_THRESHOLD, HEAP_TRIM_CEILING)
    _LIBC.mallopt(M_TOP_PAD, HEAP_TOP_PAD)


def return_free_heap() -> None:
    """Hand the free pages inside glibc's heap back to the kernel (``malloc_trim``), at the end of a phase.

    [Note: the heap between phases]
    The engine's own large buffers are mappings of their own (above), but large temporaries of the code
    around it (activations, a user's ``torch.randn`` while initialising, autograd's gradients) come from
    glibc's heap, which only shrinks from its top: small long-lived allocations made in between pin it, and
    the freed space in the middle stays resident (a loop over units that initialises each with a few
    multi-MB temporaries leaves most of them resident). The engine calls this where a phase ends
    (after a model is built on the meta device, ``fit``, a ``gathered_parameters`` block, a checkpoint;
    after every optimizer step only for runs sized by their host memory, see the next note): the
    allocator's policy is untouched, the free pages just leave, at a cost of milliseconds.

    [Note: the heap between steps]
    Between two training steps the free heap is mostly the last step's activations, which the next step
    allocates again at the same sizes. Trimming it there makes the next step fault every page of them in
    afresh (zeroed by the kernel): a slower step for a lower whole-run peak. So only engines sized by
    their host memory (the same ones that
    map large temporaries, above) trim after every optimizer step; the others trim where a phase ends.
    Parked pages (see parking.py) go back to the kernel here too."""
    parking.flush()
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)


def optimizer_state_bytes(optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """Bytes of every tensor held in the optimizers' state (Adam's moments, step counters, ...) in memory
    (state swapped out to NVMe is held as empty placeholders and counts as ``offload_nvme``)."""
    total = 0
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    total += value.nbytes  # one call per tensor: this runs after every optimizer step
    return total
