"""Released host buffers park their pages for the next buffer of the same size (engine/parking.py)."""

from __future__ import annotations

import gc

import pytest
import torch

from lightning_zero3.engine import parking
from lightning_zero3.engine.memory import STAGING, ByteLedger, releasable_buffer, reclaim, release, resident_bytes

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
