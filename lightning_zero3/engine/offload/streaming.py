"""Walking every offloaded group in order, with the next groups' reads in flight.

Everything that touches every group under NVMe offload (the optimizer step, the gradient norm, the fp16
overflow check, full-weights export, checkpoints) goes group by group: at most ``offload_buffer_count``
groups are in host memory at once, the next ones being read while the current one is used.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional, TypeVar

import torch

from .store import GroupStore

T = TypeVar("T")


def pipelined(items: Iterable[T], ahead: int, start: Callable[[T], None], finish: Callable[[T], None]) -> None:
    """``start(item)`` (issue its I/O) up to ``ahead`` items before ``finish(item)`` (use it), in order."""
    items = list(items)
    ahead = max(1, ahead)
    for item in items[:ahead]:
        start(item)
    for i, item in enumerate(items):
        if i + ahead < len(items):
            start(items[i + ahead])
        finish(item)


def gradient_pass(
    stores: list[GroupStore], buffer_count: int, use: Callable[[GroupStore, torch.Tensor], None]
) -> None:
    """``use(store, gradient)`` for every non-resident NVMe store whose gradient waits on disk: the flat
    gradient shard as the optimizer will see it (deferred operations applied), read-only, in a host buffer
    that goes back to the pool afterwards. At most ``buffer_count`` gradients are in memory at once."""
    handles: dict[int, Optional[tuple]] = {}

    def start(store: GroupStore) -> None:
        handles[id(store)] = store.gradient_for_reading()

    def finish(store: GroupStore) -> None:
        handle = handles.pop(id(store))
        if handle is None:
            return
        _, buffer, ready = handle
        try:
            use(store, ready())
        finally:
            store.offload.host.give(buffer)

    pipelined(stores, buffer_count - 1, start, finish)
