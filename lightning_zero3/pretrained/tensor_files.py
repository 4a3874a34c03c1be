"""The tensors of a checkpoint on disk, found without reading them, each readable by element range.

Formats: safetensors files (the header is parsed and checked here, the data memory-mapped), torch
state dicts (``.pt`` / ``.pth`` / ``.bin`` / ``.ckpt``, opened with ``torch.load(..., mmap=True)``;
a Lightning checkpoint's ``state_dict`` or a Fabric checkpoint's ``model`` inside), and Hugging Face
model directories: ``model.safetensors`` or ``pytorch_model.bin``, or shards listed by
``model.safetensors.index.json`` / ``pytorch_model.bin.index.json``. zero3's own exports
(``save_full_weights``, ``zero3-consolidate``) are among these.

Everything that can be known before a byte of weights is read is checked when the checkpoint is
opened: a path that is not there, a header that is cut off or not JSON, a tensor whose bytes lie past
the end of its file (a truncated download), an index that names a missing file or a tensor its file
does not hold. Reading then reads only the byte ranges asked for (see [Note: loading straight into
shards] in ``engine/layout/sources.py`` and [Note: reading a checkpoint's byte ranges] in ``reader.py``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import torch

from ..checkpoint.atomic import CheckpointError
from ..engine.layout.sources import TensorValue
from ..engine.memory.buffers import populate
from .reader import CheckpointFile

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
}  # fmt: skip
MAX_HEADER = 100 << 20  # safetensors' own limit on a header's size
INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
SINGLE_FILES = ("model.safetensors", "pytorch_model.bin")
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_model.bin")  # a peft adapter directory's weights
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


@dataclass
class FileTensor:
    """One tensor of a safetensors file (a ``TensorSource``)."""

    label: str
    shape: torch.Size
    dtype: torch.dtype
    file: CheckpointFile
    offset: int  # of its first byte in the file

    def read(self, start: int, out: torch.Tensor) -> None:
        if out.numel() == 0:  # a rank whose shard holds none of this tensor
            return
        if not out.is_contiguous():
            whole = torch.empty(out.numel(), dtype=out.dtype, device=out.device)
            self.read(start, whole)
            out.copy_(whole.view(out.shape))
            return
        flat, size = out.view(-1), self.dtype.itemsize

        def cast(offset: int, data: torch.Tensor) -> None:  # one piece: bytes -> this dtype -> out's
            if data.storage_offset() % size:
                data = data.clone()  # a tensor not aligned to its element size in the file
            values = data.view(self.dtype)
            target = flat[offset // size : offset // size + values.numel()]
            populate(target)  # while the next piece is read
            target.copy_(values)

        first = self.offset + start * size
        self.file.read(first, first + flat.numel() * size, cast)

    def release(self) -> None:
        pass  # nothing of the file stays in memory (see reader.py)


@dataclass
class Checkpoint:
    """A checkpoint's tensors by name, and what must stay open while they are read."""

    path: Path
    tensors: dict[str, Any]  # name -> TensorSource
    files: list[Any]
    adapter: bool = False  # a peft adapter directory (save_pretrained of a PeftModel): names without the adapter's

    def close(self) -> None:
        for file in self.files:
            file.close()


def open_checkpoint(path: Union[str, "os.PathLike[str]"]) -> Checkpoint:
    """Find and check the tensors of the checkpoint at ``path`` (a file or a Hugging Face directory)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"zero3: load_pretrained: {path} does not exist; pass a Hugging Face model "
                                  "directory, a .safetensors file or a torch state dict (.pt/.pth/.bin).")  # fmt: skip
    if path.is_dir():
        return _open_directory(path)
    if path.name.endswith(".index.json"):
        return _open_index(path)
    if path.suffix == ".safetensors":
        file = CheckpointFile(path)
        return Checkpoint(path, _safetensors_tensors(path, file), [file])
    if path.suffix in TORCH_SUFFIXES:
        return Checkpoint(path, _torch_tensors(path), [])
    raise CheckpointError(
        f"zero3: load_pretrained: cannot tell the format of {path}; name it .safetensors, .pt, .pth, .bin or "
        ".ckpt, or pass the Hugging Face directory that holds it."
    )


def _open_directory(path: Path) -> Checkpoint:
    for name in INDEXES:
        if (path / name).is_file():
            return _open_index(path / name)
    for name in SINGLE_FILES:
        if (path / name).is_file():
            return open_checkpoint(path / name)
    for name in ADAPTER_FILES:
        if (path / name).is_file() and (path / "adapter_config.json").is_file():
            checkpoint = open_checkpoint(path / name)
            checkpoint.adapter = True
            return checkpoint
    found = sorted(p.name for p in path.iterdir())
    looked = ", ".join(INDEXES + SINGLE_FILES + ADAPTER_FILES)
    raise CheckpointError(
        f"zero3: load_pretrained: {path} holds no weights that zero3 reads (looked for {looked}); "
        f"it holds {found[:20]}. Pass the weights file itself."
    )


def _open_index(index: Path) -> Checkpoint:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        assert isinstance(weight_map, dict)
    except (ValueError, KeyError, TypeError, AssertionError) as failure:
        raise CheckpointError(f"zero3: load_pretrained: {index} is not a weights index (a JSON object with "
                                  f"a 'weight_map'): {failure}") from None  # fmt: skip
    by_file: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(file, []).append(name)
    missing = [file for file in by_file if not (index.parent / file).is_file()]
    if missing:
        raise CheckpointError(
            f"zero3: load_pretrained: {index.name} lists {missing} (holding {by_file[missing[0]][:5]} ...), which "
            f"{index.parent} does not have: the download is incomplete."
        )
    tensors: dict[str, Any] = {}
    files: list[Any] = []
    for file_name, names in by_file.items():
        shard = index.parent / file_name
        if shard.suffix == ".safetensors":
            opened = CheckpointFile(shard)
            files.append(opened)
            held = _safetensors_tensors(shard, opened)
        else:
            held = _torch_tensors(shard)
        absent = [name for name in names if name not in held]
        if absent:
            raise CheckpointError(
                f"zero3: load_pretrained: {index.name} says {absent[:5]} are in {file_name}, which does not hold "
                "them: the index and the files do not belong together."
            )
        tensors.update({name: held[name] for name in names})
    return Checkpoint(index, tensors, files)


def _safetensors_tensors(path: Path, file: CheckpointFile) -> dict[str, FileTensor]:
    """The tensors of a safetensors file, from its header, every offset checked against the file's size."""
    size = path.stat().st_size
    with open(path, "rb", buffering=0) as stream:
        # no read-ahead: the kernel would read up to the disk's window (MBs) of tensor data past the header
        # on every rank, the bytes the ranged reads exist to avoid
        os.posix_fadvise(stream.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        head = stream.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if length < 0 or length > min(MAX_HEADER, size - 8):
            raise CheckpointError(
                f"zero3: load_pretrained: {path} is not a safetensors file or is cut off: its {size} bytes cannot "
                f"hold the header it announces ({length} bytes)."
            )
        try:
            header = json.loads(stream.read(length))
            assert isinstance(header, dict)
        except (ValueError, AssertionError) as failure:
            raise CheckpointError(f"zero3: load_pretrained: the header of {path} is corrupt: {failure}") from None
    start = 8 + length
    tensors: dict[str, FileTensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = SAFETENSORS_DTYPES[info["dtype"]]
            shape = torch.Size(info["shape"])
            first, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as failure:
            raise CheckpointError(f"zero3: load_pretrained: {path}: the entry of {name!r} is corrupt "
                                      f"({type(failure).__name__}: {failure}).") from None  # fmt: skip
        nbytes = shape.numel() * dtype.itemsize
        if end - first != nbytes or first < 0:
            raise CheckpointError(
                f"zero3: load_pretrained: {path}: {name!r} is {list(shape)} {info['dtype']} ({nbytes} bytes) but "
                f"its data offsets span {end - first} bytes: the file is corrupt."
            )
        if start + end > size:
            raise CheckpointError(
                f"zero3: load_pretrained: {path} is truncated: {name!r} needs bytes up to {start + end}, the file "
                f"has {size}. Download or copy it again."
            )
        tensors[name] = FileTensor(f"{path.name}: {name}", shape, dtype, file, start + first)
    return tensors


def _torch_tensors(path: Path) -> dict[str, TensorValue]:
    """The tensors of a torch state dict file, mapped (``mmap=True``: only what is read is touched)."""
    try:
        saved = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as failure:  # noqa: BLE001 - torch's own message, with the file named
        raise CheckpointError(
            f"zero3: load_pretrained: cannot read {path} as a torch state dict (truncated, corrupt, or saved "
            f"without torch's zip format): {type(failure).__name__}: {failure}"
        ) from None
    state = _state_dict_in(saved)
    if state is None:
        keys = list(saved)[:10] if isinstance(saved, dict) else type(saved).__name__
        raise CheckpointError(
            f"zero3: load_pretrained: {path} holds no state dict (a dict of tensors, or one under 'state_dict' "
            f"or 'model'); it holds {keys}."
        )
    return {name: TensorValue(value, f"{path.name}: {name}") for name, value in state.items() if isinstance(value, torch.Tensor)}


def _state_dict_in(saved: Any) -> dict | None:
    """The state dict inside what ``torch.load`` returned: itself, or a Lightning / Fabric checkpoint's."""
    if not isinstance(saved, dict):
        return None
    if saved and all(isinstance(v, torch.Tensor) for v in saved.values()):
        return saved
    for key in ("state_dict", "model"):
        inner = saved.get(key)
        if isinstance(inner, dict) and any(isinstance(v, torch.Tensor) for v in inner.values()):
            return inner
    return None
