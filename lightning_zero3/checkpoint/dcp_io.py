"""``torch.distributed.checkpoint`` (DCP) with zero3's flat pieces, and a reader that never unpickles code.

[Note: flat pieces in DCP]
zero3 shards a unit's parameters as one flat buffer cut into N equal slices, so a rank owns an arbitrary
*element range* of each parameter, not a block of rows. DCP speaks in chunks (offsets and sizes per
dimension) of a tensor of known global size; an element range is exactly a chunk of the parameter
*flattened* to 1-D. A ``FlatPiece`` is that chunk: this rank's elements ``[start, start + n)`` of a 1-D
tensor of ``global_numel`` elements. DCP writes each rank's pieces to that rank's own file and records
every chunk in its metadata; on load, each rank asks for the range *it* owns now and DCP reads the
overlapping parts of whichever saved chunks cover it, which is what makes resharding from N to M ranks
work without any rank ever holding a whole parameter. The planners below only teach DCP to find the
tensor inside a ``FlatPiece``; everything else is DCP's default behaviour.

[Note: checkpoints straight from the swap files]
Under NVMe offload the rank's masters and optimizer state live in swap files. DCP resolves the items of
a save one at a time and writes each before it asks for the next, and on load hands each read item to
``resolve_tensor`` / ``commit_tensor`` in turn. So a piece backed by a swap file is read from its byte
range when DCP asks for it and dropped once written; on load each read item lands in a buffer of its own
and goes straight to its byte range of the file. At most one parameter's piece is in memory at a time,
whatever the size of the model: the rank's states never pass through host memory as a whole.

[Note: weights-only loading]
DCP's file reader unpickles its ``.metadata`` file with plain ``pickle``, which can run arbitrary code.
``SafeFileSystemReader`` reads it with an unpickler that only admits DCP's own metadata classes, torch
sizes and dtypes. Tensor data DCP already loads with ``torch.load(weights_only=True)``, and zero3 puts
no pickled Python objects into DCP at all (the rest of Lightning's state goes to a separate file read
with ``weights_only=True``).
"""

from __future__ import annotations

import pickle
import queue
import warnings
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generator, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, FileSystem
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ..engine.memory.buffers import OFFLOAD_HOST, ByteLedger, host_buffer
from ..engine.offload.aio import read_range, write_range
from ..engine.offload.swapdir import SwapFile
from ..export.digests import DigestBook


@dataclass(frozen=True)
class FileRange:
    """Where a piece's values live when they are not in memory: a swap file and a byte offset in it, and the
    ledger that counts the host buffers the piece passes through."""

    file: SwapFile
    offset: int
    ledger: Optional[ByteLedger] = None

    def buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer of its own for one piece, counted in the ledger for as long as it lives."""
        values = host_buffer(numel, dtype)
        if self.ledger is not None:
            nbytes = values.numel() * values.element_size()
            self.ledger.add(OFFLOAD_HOST, nbytes)
            weakref.finalize(values, self.ledger.remove, OFFLOAD_HOST, nbytes)
        return values


@dataclass
class FlatPiece:
    """This rank's elements ``[start, start + tensor.numel())`` of a flattened tensor of ``global_numel``
    elements. ``tensor`` is 1-D: what is written on save, what is filled in place on load.

    With ``source`` set (NVMe offload), ``tensor`` is a meta tensor that only gives the size and dtype,
    and the values are read from (or written to) the swap file piece by piece while DCP works through the
    items one at a time: see [Note: checkpoints straight from the swap files]."""

    tensor: torch.Tensor
    start: int
    global_numel: int
    shape: tuple = ()  # the tensor's own shape before flattening (for the manifest); () means 1-D
    source: Optional[FileRange] = None
    bucket: str = ""  # pieces of one bucket (a flat group) share a file: see [Note: one file per group]

    def __post_init__(self) -> None:
        if not self.shape:
            self.shape = (self.global_numel,)

    def read(self) -> torch.Tensor:
        """The piece's values in a fresh host buffer of its own (handed back to the kernel once dropped)."""
        assert self.source is not None
        values = self.source.buffer(self.tensor.numel(), self.tensor.dtype)
        read_range(self.source.file, values, self.source.offset)
        return values

    def _chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size([self.start]), sizes=torch.Size([self.tensor.numel()]))

    # the two hooks DCP's default planners look for on a state-dict value (its "checkpointable" protocol)
    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        chunk = self._chunk()
        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=chunk,
                    properties=TensorProperties.create_from_tensor(self.tensor),
                    size=torch.Size([self.global_numel]),
                ),
            )
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk()]


def _resolve(state_dict: dict[str, Any], index: MetadataIndex) -> Optional[torch.Tensor]:
    value = state_dict.get(index.fqn)
    if not isinstance(value, FlatPiece):
        return None
    if value.source is not None:
        return value.read()
    tensor = value.tensor
    if tensor.device.type == "cpu" and tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        # DCP writes whole storages: a view of a shard would be cloned on the heap; a mapping of its own
        # goes back to the kernel once written (see [Note: the heap between phases] in engine/memory/buffers.py)
        copy = host_buffer(tensor.numel(), tensor.dtype)
        copy.copy_(tensor)
        return copy
    return tensor


class NonFiniteStateError(ValueError):
    """A tensor about to be saved holds NaN or inf; the message names it and the step."""


def refuse_non_finite(name: str, tensor: torch.Tensor, step: Optional[int]) -> None:
    """Raise ``NonFiniteStateError`` if ``tensor`` (about to be written as ``name``) holds NaN or inf.

    [Note: the finiteness check rides on the save]
    The check runs on each tensor as DCP takes it to write, when its bytes are in memory anyway (under NVMe
    offload, the buffer just read from the swap file), so it adds no read of offloaded state. It sums the
    tensor first (NaN and inf survive a sum, so a finite sum means a finite tensor) and only a non-finite
    sum, which an overflow of large finite values can also give, is confirmed element by element."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return
    if bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all()):
        return
    bad = (~torch.isfinite(tensor)).sum().item()
    at = f"at step {step}" if step is not None else "(no step recorded)"
    raise NonFiniteStateError(
        f"zero3: refusing to save a checkpoint {at}: {name} holds {bad} non-finite value(s) (NaN or inf) out of "
        f"{tensor.numel()}, so the run diverged before this save. Resume from an earlier checkpoint (lower the "
        "learning rate, clip gradients, or use bf16 instead of fp16), or set "
        "`Zero3Config(save_non_finite=True)` to keep such checkpoints anyway."
    )


class _PieceSavePlanner(dcp.DefaultSavePlanner):
    """DCP's planner, taught to find a ``FlatPiece``'s tensor; it refuses non-finite tensors unless
    ``allow_non_finite`` (see [Note: the finiteness check rides on the save])."""

    def __init__(self, step: Optional[int] = None, allow_non_finite: bool = True) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.step, self.allow_non_finite = step, allow_non_finite

    def lookup_object(self, index: MetadataIndex) -> Any:
        tensor = _resolve(self.state_dict, index)
        if tensor is None:
            tensor = super().lookup_object(index)
        if not self.allow_non_finite and torch.is_tensor(tensor):
            refuse_non_finite(index.fqn, tensor, self.step)
        return tensor


class _PieceLoadPlanner(dcp.DefaultLoadPlanner):
    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Optional[Metadata] = None, is_coordinator: bool = False) -> None:
        # The default set-up first rewrites values it does not know (a FlatPiece would become None); the
        # state dict here is flat and already holds real tensors, so there is nothing to set up.
        self.original_state_dict = self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        value = self.state_dict.get(index.fqn)
        if isinstance(value, FlatPiece):
            return value.tensor
        return super().lookup_tensor(index)

    def resolve_tensor(self, read_item: Any) -> torch.Tensor:
        piece = self.state_dict.get(read_item.dest_index.fqn)
        if isinstance(piece, FlatPiece) and piece.source is not None:  # filled here, then written to the file
            return piece.source.buffer(int(read_item.lengths[0]), piece.tensor.dtype)
        return super().resolve_tensor(read_item)

    def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
        piece = self.state_dict.get(read_item.dest_index.fqn)
        if isinstance(piece, FlatPiece) and piece.source is not None:
            offset = piece.source.offset + int(read_item.dest_offsets[0]) * tensor.element_size()
            write_range(piece.source.file, tensor, offset)
            return
        super().commit_tensor(read_item, tensor)


# -- reading metadata without running code --------------------------------------------------------

_DCP_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch._utils", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint's metadata asks to build an object that weights-only loading does not allow."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"zero3: the checkpoint metadata asks for {module}.{name}, which weights-only loading refuses "
            "(it could run code). The file was not written by zero3 or was tampered with."
        )


def read_dcp_metadata(path: Path) -> Metadata:
    with open(path / ".metadata", "rb") as stream:
        return _MetadataUnpickler(stream).load()


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader, with the metadata read by the restricted unpickler (see [Note: weights-only loading])."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if rank is not None:
            raise NotImplementedError("zero3 checkpoints have one metadata file")
        metadata = read_dcp_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


# -- save / load ----------------------------------------------------------------------------------


def _distributed(group: Optional[dist.ProcessGroup]) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


class _BucketedWriter(dcp.FileSystemWriter):
    """DCP's file writer with one file per bucket of pieces (see [Note: one file per group]).

    [Note: one file per group]
    DCP's file writer keeps every tensor it has written into a file until that file is complete (torch
    2.13 collects them for its safetensors format whatever the format). With one file per rank, a save
    would hold the rank's whole checkpoint in memory, exactly what sharding and offload avoid. So each
    rank writes one file per flat group (its pieces of the group's parameters and optimizer state, about
    one unit), and at most one group's pieces are alive at once. Loading reads any number of files."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        buckets: dict[str, list] = {}
        for item in plan.items:
            value = planner.state_dict.get(item.index.fqn)
            buckets.setdefault(value.bucket if isinstance(value, FlatPiece) else "", []).append(item)
        files: queue.Queue = queue.Queue()
        for count, items in enumerate(buckets.values()):
            name = f"{plan.storage_data.prefix}{count}{DEFAULT_SUFFIX}"
            files.put((self.fs.concat_path(self.path, name), name, items))
        return self._write_data(planner, files)


class _DigestingFileSystem(FileSystem):
    """DCP's local file system, recording the checksum of every file written through it (each shard file
    and, on the coordinator, ``.metadata``) in ``book``: see [Note: checksums while the bytes stream out]
    in export/digests.py."""

    def __init__(self, book: DigestBook) -> None:
        super().__init__()
        self.book = book

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Generator[Any, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        name = Path(path).name
        with super().create_stream(path, mode) as raw:
            yield self.book.stream(raw, name)
        self.book.close(name)

    def rename(self, path: Any, new_path: Any) -> None:
        super().rename(path, new_path)
        self.book.rename(Path(path).name, Path(new_path).name)


def save_pieces(
    state: dict[str, Any],
    path: Path,
    group: Optional[dist.ProcessGroup] = None,
    book: Optional[DigestBook] = None,
    step: Optional[int] = None,
    allow_non_finite: bool = True,
) -> None:
    """Each rank of ``group`` writes its ``FlatPiece``s (and, once, any plain tensor) into ``path``.

    ``book``: records the checksum of each file this rank writes. ``allow_non_finite=False``: a tensor
    holding NaN or inf fails the save with ``NonFiniteStateError`` naming it and ``step``."""
    writer = _BucketedWriter(path, sync_files=True, single_file_per_rank=True)
    if book is not None:
        writer.fs = _DigestingFileSystem(book)
    planner = _PieceSavePlanner(step, allow_non_finite)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")  # one process: no group
        dcp.save(state, storage_writer=writer, planner=planner, process_group=group,
                 no_dist=not _distributed(group))  # fmt: skip


def files_read(state: dict[str, Any], path: Path) -> set[str]:
    """The names of the checkpoint files at ``path`` that ``load_pieces(state, path)`` reads on this rank."""
    metadata = read_dcp_metadata(path)
    planner = _PieceLoadPlanner()
    planner.set_up_planner(state, metadata)
    return {metadata.storage_data[item.storage_index].relative_path for item in planner.create_local_plan().items}


def load_pieces(
    state: dict[str, Any], path: Path, group: Optional[dist.ProcessGroup] = None, collective: bool = True
) -> None:
    """Fill every ``FlatPiece`` / tensor of ``state`` in place from the checkpoint at ``path``.

    ``collective=False`` reads in this process alone (consolidation); otherwise every rank of ``group`` calls it."""
    reader = SafeFileSystemReader(path)
    no_dist = not (collective and _distributed(group))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        dcp.load(state, storage_reader=reader, planner=_PieceLoadPlanner(), process_group=group, no_dist=no_dist)
