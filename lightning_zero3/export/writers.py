"""Files of full tensors written one tensor at a time: ``torch.save`` format and safetensors.

Both consolidation (``checkpoint/consolidate.py``: tensors read from a sharded checkpoint) and full-weight exports
from a live run (``full_weights.py``: tensors gathered unit by unit) hold one tensor, or one unit, at a time;
the whole model never exists in one process.

[Note: a torch.save file, tensor by tensor]
``torch.save`` pickles the object (tensors become references to *storage records*) and then writes each
storage's bytes as a record of a zip archive. ``TorchFileWriter`` does the same in two steps: the
object is pickled at once, with *placeholders* (tensors over memory that is reserved but never touched,
so they cost no resident memory) for the tensors that arrive later, and ``fill`` writes the bytes of one
placeholder's record when its values are ready. Records may come in any order: ``torch.load`` looks them
up by name. The zip writer is torch's own, so every record carries its true CRC-32 and Python's
``zipfile`` verifies the archive. The pickling follows ``torch.serialization._save`` (one key per storage,
numbered in the order the pickler meets them); ``torch.load(..., weights_only=True)`` reads the result.

safetensors: the header (names, dtypes, shapes, byte offsets) is known before any data, so it is
written first and the tensors are appended in header order.
"""

from __future__ import annotations

import io
import json
import pickle
import struct
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from ..engine.memory.buffers import host_buffer
from .digests import DigestingStream


def staging_path(final: Path) -> Path:
    """The hidden sibling ``.<name>.partial-<id>`` that a file or directory is written under, and renamed
    from once whole (see [Note: atomic checkpoint directories] in checkpoint/atomic.py): nothing takes it for
    ``final``, and a write that was killed leaves only a name that ``stale_staging_paths`` finds."""
    return final.parent / f".{final.name}.partial-{uuid.uuid4().hex[:12]}"


def stale_staging_paths(final: Path) -> Iterator[Path]:
    """What writes of ``final`` that never finished left behind."""
    return final.parent.glob(f".{final.name}.partial-*")


def failures_everywhere(error: Optional[str], all_gather_objects: Callable[[Any], list]) -> dict[int, str]:
    """This rank's outcome of a write (an error message, or None) traded for every rank's: rank -> message
    of each rank where it failed, the same dict on every rank (a collective). Parts of a write run on one
    rank alone; were that rank to raise there, the others would wait in the next collective until the
    timeout (see [Note: a failed save fails everywhere] in checkpoint/api.py)."""
    return {rank: outcome for rank, outcome in enumerate(all_gather_objects(error)) if outcome is not None}

_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}  # fmt: skip


@dataclass
class TensorEntry:
    """One tensor of an output file: its names (a tied weight has several), shape and dtype."""

    names: list[str]
    shape: list[int]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy())


def placeholder(entry: TensorEntry) -> torch.Tensor:
    """A tensor of ``entry``'s shape over reserved, untouched memory (see the note above)."""
    return host_buffer(entry.numel, entry.dtype).view(entry.shape)


# -- safetensors -------------------------------------------------------------------------------------


def write_safetensors(
    out: Path, entries: list[TensorEntry], tensors: Iterable[torch.Tensor], metadata: dict | None = None,
    digest: Any = None,
) -> None:
    """Write ``entries`` to ``out``; ``tensors`` yields each entry's values, in the same order. ``digest``: a
    running checksum (``digests.new_digest``) that every written byte also goes into."""
    header: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for entry in entries:
        if entry.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"zero3: safetensors has no dtype for {entry.names[0]} ({entry.dtype}); write .pt instead.")
        for name in entry.names:  # a tied weight is stored once per name: safetensors has no aliases
            header[name] = {"dtype": _SAFETENSORS_DTYPES[entry.dtype], "shape": list(entry.shape),
                            "data_offsets": [offset, offset + entry.nbytes]}  # fmt: skip
            offset += entry.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(out, "wb") as raw:
        stream = raw if digest is None else DigestingStream(raw, digest)
        stream.write(struct.pack("<Q", len(encoded)))
        stream.write(encoded)
        for entry, tensor in zip(entries, tensors):
            data = tensor_bytes(tensor)
            if len(data) != entry.nbytes:
                raise ValueError(f"zero3: {entry.names[0]} has {len(data)} bytes, expected {entry.nbytes}.")
            for _ in entry.names:
                stream.write(data)


# -- [Note: a torch.save file, tensor by tensor] ---------------------------------------------------------


class TorchFileWriter:
    """``torch.save(obj, path)`` where the tensors in ``later`` get their bytes through ``fill``."""

    def __init__(self, path: Path, obj: Any, later: Iterable[torch.Tensor]) -> None:
        self._later = {t.untyped_storage()._cdata for t in later}
        self._keys: dict[int, str] = {}  # storage cdata -> record key
        self._storages: dict[str, torch.UntypedStorage] = {}
        self._zip_context = torch.serialization._open_zipfile_writer(str(path))
        self._zip = self._zip_context.__enter__()
        try:
            data = self._pickle(obj)
            self._zip.write_record("data.pkl", data, len(data))
            self._zip.write_record(".format_version", "1", len("1"))
            alignment = str(torch.serialization._get_storage_alignment())
            self._zip.write_record(".storage_alignment", alignment, len(alignment))
            self._zip.write_record("byteorder", sys.byteorder, len(sys.byteorder))
            for key, storage in self._storages.items():
                if storage._cdata not in self._later:
                    self._zip.write_record(f"data/{key}", storage, storage.nbytes())
            self._waiting = {cdata for cdata in self._later if cdata in self._keys}
        except BaseException:
            self._zip_context.__exit__(*sys.exc_info())
            raise

    def _pickle(self, obj: Any) -> bytes:
        keys, storages = self._keys, self._storages

        class Pickler(pickle.Pickler):
            def persistent_id(self, value: Any) -> Any:
                if isinstance(value, torch.storage.TypedStorage):
                    storage, dtype = value._untyped_storage, value.dtype
                    storage_type = getattr(torch, value._pickle_storage_type())
                    numel = value._size()
                elif torch.is_storage(value):
                    storage, dtype = value, torch.uint8
                    storage_type = torch.serialization.normalize_storage_type(type(value))
                    numel = storage.nbytes()
                else:
                    return None
                del dtype
                key = keys.setdefault(storage._cdata, str(len(keys)))
                storages[key] = storage
                return ("storage", storage_type, key, torch.serialization.location_tag(storage), numel)

        buffer = io.BytesIO()
        Pickler(buffer, protocol=torch.serialization.DEFAULT_PROTOCOL).dump(obj)
        return buffer.getvalue()

    def fill(self, later: torch.Tensor, values: torch.Tensor) -> None:
        """Write the record of the placeholder ``later`` from ``values`` (same number of bytes)."""
        cdata = later.untyped_storage()._cdata
        if cdata not in self._waiting:
            raise ValueError("zero3: this tensor is not a placeholder of this file, or was written already")
        data = values.detach().contiguous().view(-1)
        nbytes = data.numel() * data.element_size()
        if nbytes != later.untyped_storage().nbytes():
            raise ValueError("zero3: the values do not have the placeholder's size")
        if data.storage_offset() or data.untyped_storage().nbytes() != nbytes:
            data = data.clone()  # a record is a whole storage: a view of a larger buffer gets one of its own
        self._zip.write_record(f"data/{self._keys[cdata]}", data.untyped_storage(), nbytes)
        self._waiting.discard(cdata)

    def close(self) -> None:
        """Finish the archive (every placeholder must have been filled)."""
        if self._waiting:
            self._zip_context.__exit__(None, None, None)
            raise RuntimeError(f"zero3: {len(self._waiting)} tensor(s) of the file were never written")
        self._zip_context.__exit__(None, None, None)

    def abort(self) -> None:
        self._zip_context.__exit__(None, None, None)


def write_torch(out: Path, entries: list[TensorEntry], tensors: Iterator[torch.Tensor]) -> None:
    """A ``torch.save`` file of ``{name: tensor}`` for ``entries`` (tied names share one tensor), the values
    coming one at a time from ``tensors`` in entry order."""
    holders = [placeholder(entry) for entry in entries]
    obj = {name: holder for entry, holder in zip(entries, holders) for name in entry.names}
    writer = TorchFileWriter(out, obj, holders)
    try:
        for holder, values in zip(holders, tensors):
            writer.fill(holder, values)
    except BaseException:
        writer.abort()
        raise
    writer.close()
