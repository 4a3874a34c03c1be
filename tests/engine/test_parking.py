"""Released host buffers park their pages for the next buffer of the same size (engine/parking.py)."""

from __future__ import annotations

import gc

import pytest
import torch

from lightning_zero3.engine.memory import parking
from lightning_zero3.engine.memory.buffers import (
    STAGING,
    ByteLedger,
    reclaim,
    releasable_buffer,
    release,
    resident_bytes,
)

NUMEL = 1 << 20  # 4 MiB of float32 per buffer


@pytest.fixture(autouse=True)
def _empty_lot():
    parking.flush()
    yield
    parking.flush()


def _filled(value: float) -> torch.Tensor:
    buffer = releasable_buffer(NUMEL, torch.float32, torch.device("cpu"))
    buffer.fill_(value)
    return buffer


def test_a_released_buffer_hands_its_pages_to_the_next_buffer_of_its_size_without_a_fault():
    if not parking.can_park():
        pytest.skip("this kernel cannot move pages (mremap without MREMAP_DONTUNMAP)")
    ledger = ByteLedger()
    first, second = _filled(1.0), _filled(2.0)
    release(second)  # without a ledger: given back to the kernel at once, as before
    assert resident_bytes(second) == 0
    release(first, ledger)
    assert resident_bytes(first) == NUMEL * 4 and ledger.held[STAGING] == NUMEL * 4  # parked, counted
    reclaim(second)
    # the pages moved: the parked buffer is empty, the reclaimed one has them before anything is written
    assert resident_bytes(first) == 0 and resident_bytes(second) == NUMEL * 4
    assert ledger.held[STAGING] == 0 and not parking.holds(first._zero3_region)
    second.fill_(3.0)
    assert torch.all(second == 3.0) and torch.all(first == 0.0)  # the empty one reads zeros


def test_a_buffer_in_use_never_loses_its_pages():
    ledger = ByteLedger()
    first, second, third = _filled(1.0), _filled(2.0), _filled(3.0)
    release(first, ledger)
    reclaim(first)  # its own pages back, in place
    first.fill_(7.0)
    release(third)
    release(second, ledger)
    reclaim(third)  # takes the second's pages, not the first's: the first is in use
    assert torch.all(first == 7.0)
    reclaim(third)  # a second reclaim of a buffer in use moves nothing into it
    third.fill_(5.0)
    release(second, ledger)
    reclaim(first)  # not released: keeps its contents
    assert torch.all(first == 7.0) and torch.all(third == 5.0)


def test_parked_pages_are_bounded_flushed_and_uncounted_when_their_map_dies():
    ledger = ByteLedger()
    buffers = [_filled(float(i)) for i in range(parking.PARKED_BUFFERS + 2)]
    for buffer in buffers:
        release(buffer, ledger)
    parked = [b for b in buffers if parking.holds(b._zero3_region)]
    assert parked == buffers[-parking.PARKED_BUFFERS :]  # the newest stay; the older went to the kernel
    assert sum(resident_bytes(b) for b in buffers) == ledger.held[STAGING] == parking.PARKED_BUFFERS * NUMEL * 4
    del parked, buffer
    buffers.pop()
    gc.collect()  # a parked map that is dropped takes its pages with it, and off the ledger
    assert ledger.held[STAGING] == (parking.PARKED_BUFFERS - 1) * NUMEL * 4
    parking.flush()
    assert ledger.held[STAGING] == 0 and sum(resident_bytes(b) for b in buffers) == 0


def _huge_page_kib(tensor: torch.Tensor) -> int:
    """KiB of ``tensor``'s map that huge pages back (the kernel's ``AnonHugePages`` of that mapping)."""
    start, inside, total = tensor.untyped_storage().data_ptr(), False, 0
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                low, high = (int(bound, 16) for bound in head[0].split("-"))
                inside = low <= start < high
            elif inside and head[0] == "AnonHugePages:":
                total += int(head[1])
    return total


def test_buffers_start_on_a_huge_page_boundary_and_moved_pages_stay_huge():
    """[Note: buffers start on a huge-page boundary] in engine/memory/buffers.py: a move between buffers at different
    offsets from a 2 MiB boundary split the huge pages (AnonHugePages 0 after the move, 22 MiB before)."""
    if not parking.can_park():
        pytest.skip("this kernel cannot move pages (mremap without MREMAP_DONTUNMAP)")
    source, target = _filled(1.0), _filled(0.0)
    assert source.data_ptr() % (2 << 20) == 0 and target.data_ptr() % (2 << 20) == 0
    huge_before = _huge_page_kib(source)
    if huge_before == 0:
        pytest.skip("no huge page backs a buffer on this host (transparent_hugepage 'never', or none was free "
                    "when it was filled): there is nothing that could stay huge")  # fmt: skip
    release(target)
    release(source, ByteLedger())
    reclaim(target)  # takes the source's parked pages
    assert resident_bytes(target) == NUMEL * 4 and bool((target == 1.0).all())
    assert _huge_page_kib(target) == huge_before > 0
