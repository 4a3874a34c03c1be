"""Consolidate a sharded checkpoint into one file of full weights, tensor by tensor.

    python -m lightning_zero3.checkpoint.consolidate CHECKPOINT_DIR OUT.pt        # torch.save format
    python -m lightning_zero3.checkpoint.consolidate CHECKPOINT_DIR OUT.safetensors
    zero3-consolidate CHECKPOINT_DIR OUT.pt --prefix model.    # keep "model.*", strip the prefix

The output is a plain ``state_dict`` under the model's own names (tied weights under each name), that
``model.load_state_dict(torch.load(OUT.pt, weights_only=True))`` takes with no zero3 installed.

[Note: streaming consolidation]
One process, no process group. For each tensor in turn: allocate it full, let DCP read every saved
piece of it into place, write its bytes to the output, free it. Peak memory is about the largest
tensor (twice, while DCP copies a piece in) over the process baseline, never the model.
- safetensors: the header (names, dtypes, shapes, byte offsets) is known from the manifest before any
  data, so it is written first and the tensors are appended in order.
- torch format: ``torch.save`` wants every tensor at once. Under ``torch.serialization.skip_data()`` it
  writes the whole file (pickle and zip directory) without tensor bytes, from tensors that are only
  reserved (``torch.empty`` touches no page); the bytes are then written in place, tensor by tensor,
  at the offsets the zip reader reports. ``torch.load`` reads the result like any ``torch.save`` file
  (the zip records' CRCs are those of the skipped bytes, which torch does not check).
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from pathlib import Path
from typing import Iterator, Optional

import torch

from .atomic import read_manifest
from .dcp_io import FlatPiece, load_pieces
from .sharded import MODEL_PREFIX

_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}  # fmt: skip


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


class _Entry:
    """One tensor of the output: its names (first is the saved key), shape and dtype."""

    def __init__(self, names: list[str], shape: list[int], dtype: str, is_param: bool) -> None:
        self.names, self.shape, self.dtype, self.is_param = names, shape, _dtype(dtype), is_param

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def _entries(manifest: dict, prefix: str) -> list[_Entry]:
    entries = [_Entry([name, *p["aliases"]], p["shape"], p["dtype"], True) for name, p in manifest["params"].items()]
    entries += [_Entry([name], b["shape"], b["dtype"], False) for name, b in manifest["buffers"].items()]
    for entry in entries:
        entry.names = [n.removeprefix(prefix) for n in entry.names if n.startswith(prefix)]
    return [e for e in entries if e.names]


def _read_full(path: Path, entry: _Entry, key: str) -> torch.Tensor:
    """One tensor, whole, read from every rank's pieces (this process alone)."""
    full = torch.empty(entry.numel, dtype=entry.dtype)
    target = FlatPiece(full, 0, entry.numel) if entry.is_param else full.view(entry.shape)
    load_pieces({MODEL_PREFIX + key: target}, path, collective=False)
    return full


def _tensors(path: Path, entries: list[_Entry], prefix: str) -> Iterator[tuple[_Entry, torch.Tensor]]:
    for entry in entries:
        yield entry, _read_full(path, entry, prefix + entry.names[0])


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.contiguous().view(-1).view(torch.uint8).numpy())


def _write_safetensors(path: Path, out: Path, entries: list[_Entry], prefix: str) -> None:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for entry in entries:
        if entry.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"zero3: safetensors has no dtype for {entry.names[0]} ({entry.dtype}); write .pt instead.")
        for name in entry.names:  # a tied weight is stored once per name: safetensors has no aliases
            header[name] = {"dtype": _SAFETENSORS_DTYPES[entry.dtype], "shape": entry.shape,
                            "data_offsets": [offset, offset + entry.nbytes]}  # fmt: skip
            offset += entry.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(out, "wb") as stream:
        stream.write(struct.pack("<Q", len(encoded)))
        stream.write(encoded)
        for entry, tensor in _tensors(path, entries, prefix):
            for _ in entry.names:
                stream.write(_bytes_of(tensor))
            del tensor


def _write_torch(path: Path, out: Path, entries: list[_Entry], prefix: str) -> None:
    reserved = [torch.empty(entry.shape, dtype=entry.dtype) for entry in entries]  # no page touched
    skeleton = {name: tensor for entry, tensor in zip(entries, reserved) for name in entry.names}
    with torch.serialization.skip_data():
        torch.save(skeleton, out)
    del skeleton, reserved
    reader = torch._C.PyTorchFileReader(str(out))
    records = {r.rsplit("/", 1)[-1]: r for r in reader.get_all_records() if "/data/" in f"/{r}"}
    offsets = [reader.get_record_offset(records[str(i)]) for i in range(len(entries))]  # storage i = entry i
    del reader
    with open(out, "r+b") as stream:
        for (entry, tensor), offset in zip(_tensors(path, entries, prefix), offsets):
            stream.seek(offset)
            stream.write(_bytes_of(tensor))
            del tensor


def consolidate_checkpoint(checkpoint: Path, out: Path, fmt: Optional[str] = None, prefix: str = "") -> Path:
    """Write the full weights of the sharded ``checkpoint`` to ``out`` (``"pt"`` or ``"safetensors"``, by
    default from the suffix), keeping the names under ``prefix`` with the prefix removed."""
    checkpoint, out = Path(checkpoint), Path(out)
    manifest = read_manifest(checkpoint)
    fmt = fmt or ("safetensors" if out.suffix == ".safetensors" else "pt")
    if fmt not in ("pt", "safetensors"):
        raise ValueError(f"zero3: unknown output format {fmt!r}; use 'pt' or 'safetensors'.")
    entries = _entries(manifest, prefix)
    if not entries:
        raise ValueError(f"zero3: no tensor of {checkpoint} has a name starting with {prefix!r}.")
    staging = out.with_name(f".{out.name}.partial")
    writer = _write_safetensors if fmt == "safetensors" else _write_torch
    writer(checkpoint, staging, entries, prefix)
    staging.replace(out)  # the output appears whole or not at all
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="zero3-consolidate", description="Write one file of full weights from a zero3 sharded checkpoint."
    )
    parser.add_argument("checkpoint", type=Path, help="the sharded checkpoint directory")
    parser.add_argument("out", type=Path, help="output file: .pt (torch.save format) or .safetensors")
    parser.add_argument("--format", choices=["pt", "safetensors"], help="default: from the output's suffix")
    parser.add_argument("--prefix", default="", help="keep only names starting with this, and strip it (e.g. 'model.')")
    args = parser.parse_args(argv)
    out = consolidate_checkpoint(args.checkpoint, args.out, args.format, args.prefix)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
