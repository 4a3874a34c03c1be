"""Large buffers and the byte ledger.

Every large tensor the engine holds is allocated here (``new_buffer``), and every gathered buffer is
freed and re-allocated here (``free_storage`` / ``restore_storage``), so the ledger knows at each moment
how many bytes the engine holds by category. Tests cross-check the ledger against the real tensors.

[Note: freeing by storage resize]
A gathered parameter is a view into its unit's flat ``full`` buffer. To release it we shrink the
buffer's storage to zero bytes instead of dropping the tensor: every view (the user's ``nn.Parameter``
objects, references held by optimizers or by autograd) stays the same Python object and becomes valid
again when the storage is grown back and refilled. torch FSDP frees its unsharded parameters the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch

# Categories of bytes that the engine holds.
PARAM_SHARDS = "param_shards"  # this rank's 1/N of every sharded parameter (the optimizer's parameters)
GRAD_SHARDS = "grad_shards"  # this rank's 1/N of every gradient, in the shard dtype
PERSISTENT_PARAMS = "persistent_params"  # whole copies of the small parameters every rank keeps
GATHERED_PARAMS = "gathered_params"  # full parameters of units gathered right now
OFFLOAD_HOST = "offload_host"  # host-memory tier of offload: master / gradient shards, staging buffers
OFFLOAD_NVME = "offload_nvme"  # bytes of swap files on the NVMe tier (on disk, not in memory)
CATEGORIES = (PARAM_SHARDS, GRAD_SHARDS, PERSISTENT_PARAMS, GATHERED_PARAMS, OFFLOAD_HOST, OFFLOAD_NVME)


@dataclass
class ByteLedger:
    """Bytes held per category on this rank, and the peak of gathered bytes."""

    held: dict = field(default_factory=lambda: {c: 0 for c in CATEGORIES})
    peak_gathered: int = 0

    def add(self, category: str, nbytes: int) -> None:
        self.held[category] += nbytes
        if category == GATHERED_PARAMS:
            self.peak_gathered = max(self.peak_gathered, self.held[category])

    def remove(self, category: str, nbytes: int) -> None:
        self.held[category] -= nbytes
        assert self.held[category] >= 0, f"byte ledger went negative for {category}"

    def reset_peak(self) -> None:
        self.peak_gathered = self.held[GATHERED_PARAMS]


def new_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat zero-filled buffer. Created outside inference mode, so later training may write to it."""
    with torch.inference_mode(False):
        return torch.zeros(numel, dtype=dtype, device=device)


def host_buffer(numel: int, dtype: torch.dtype, pin: bool = False) -> torch.Tensor:
    """An uninitialised flat host buffer for offload; page-locked when ``pin`` (asynchronous copies to CUDA)."""
    with torch.inference_mode(False):
        return torch.empty(numel, dtype=dtype, pin_memory=pin)


def free_storage(tensor: torch.Tensor) -> None:
    """Give the memory of ``tensor`` back; the tensor (and its views) survive with an empty storage."""
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


def restore_storage(tensor: torch.Tensor) -> None:
    """Re-allocate the storage freed by ``free_storage`` (contents undefined until written)."""
    storage = tensor.untyped_storage()
    nbytes = tensor.numel() * tensor.element_size()
    if storage.size() != nbytes:
        storage.resize_(nbytes)


def storage_is_freed(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage().size() == 0


def optimizer_state_bytes(optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """Bytes of every tensor held in the optimizers' state (Adam's moments, step counters, ...) in memory
    (state swapped out to NVMe is held as empty placeholders and counts as ``offload_nvme``)."""
    total = 0
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    total += value.numel() * value.element_size()
    return total
