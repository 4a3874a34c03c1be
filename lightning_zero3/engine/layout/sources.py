"""Parameter values that come from outside the model, read piece by piece: a pretrained checkpoint.

[Note: loading straight into shards]
A unit's shard is one contiguous range of its flat buffer (see ``shard/flat_group.py``), so this rank's piece of
each parameter is one contiguous range of that parameter flattened (``ParamSlot.piece_start``), and of
a row-major tensor in a file it is one contiguous byte range. A ``TensorSource`` copies such a range of
its tensor into a given tensor, casting on the way (a bf16 file into fp32 masters). So each rank copies
exactly its own pieces from the file into its master shard: no rank reads or holds a whole sharded
tensor, and no collective moves a weight. Persistent parameters (small, kept whole on every rank) are
read whole by every rank, buffers too.

A model built on the meta device cannot be written into: ``attach`` leaves the sources on the module
until an engine shards it. The engine then builds the units whose parameters all have a source
without initialising or broadcasting them (their shards are filled from the sources once every unit is
built, ``loading.load_sources``), and initialises only what the checkpoint does not hold.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from ..memory.buffers import drop_pages


class TensorSource(Protocol):
    """One tensor of a checkpoint, readable by element range."""

    #: where it comes from, for messages (file and name in it)
    label: str
    shape: torch.Size

    def read(self, start: int, out: torch.Tensor) -> None:
        """Copy elements ``[start, start + out.numel())`` of the flattened tensor into ``out`` (cast to its dtype)."""
        ...

    def release(self) -> None:
        """The pages read so far are not needed any more (a mapped file's pages go back to the kernel)."""
        ...


@dataclass
class PendingValues:
    """Sources for a module's tensors, by identity: parameters by ``id``, buffers by (``id`` of the module
    holding them, buffer name). ``keep`` holds what must stay alive while they are read (open files)."""

    params: dict[int, TensorSource] = field(default_factory=dict)
    buffers: dict[tuple[int, str], TensorSource] = field(default_factory=dict)
    keep: list = field(default_factory=list)

    def merge(self, other: "PendingValues") -> None:
        self.params.update(other.params)
        self.buffers.update(other.buffers)
        self.keep.extend(other.keep)

    def __bool__(self) -> bool:
        return bool(self.params or self.buffers)


# sources attached to modules on the meta device, waiting for the engine that shards them
_PENDING: "weakref.WeakKeyDictionary[nn.Module, PendingValues]" = weakref.WeakKeyDictionary()


def attach(module: nn.Module, values: PendingValues) -> None:
    """Leave ``values`` on ``module`` for the engine that will shard it (a later call adds to them)."""
    pending = _PENDING.setdefault(module, PendingValues())
    pending.merge(values)


def pending_on(root: nn.Module) -> bool:
    """Whether ``root`` or a module inside it carries sources not yet taken."""
    return any(module in _PENDING for module in root.modules())


def take(root: nn.Module) -> PendingValues:
    """Every source attached to ``root`` or a module inside it, removed from them."""
    values = PendingValues()
    for module in root.modules():
        found = _PENDING.pop(module, None)
        if found is not None:
            values.merge(found)
    return values


class TensorValue:
    """A whole tensor as a source: a state dict's value, possibly mapped from a file by
    ``torch.load(..., mmap=True)`` (its pages go back to the kernel once read, see ``drop_pages``)."""

    def __init__(self, tensor: torch.Tensor, label: str) -> None:
        self.tensor = tensor
        self.label = label
        self.shape = tensor.shape

    def read(self, start: int, out: torch.Tensor) -> None:
        out.copy_(self.tensor.reshape(-1)[start : start + out.numel()])

    def release(self) -> None:
        drop_pages(self.tensor)


def read_whole(source: TensorSource, target: torch.Tensor) -> None:
    """Copy all of ``source`` into ``target`` (same number of elements, any layout), casting."""
    if target.is_contiguous():
        source.read(0, target.view(-1))
        return
    whole = torch.empty(target.numel(), dtype=target.dtype, device=target.device)
    source.read(0, whole)
    target.copy_(whole.view(target.shape))
