"""Consolidate a sharded checkpoint into one file of full weights, tensor by tensor.

    python -m lightning_zero3.checkpoint.consolidate CHECKPOINT_DIR OUT.pt        # torch.save format
    python -m lightning_zero3.checkpoint.consolidate CHECKPOINT_DIR OUT.safetensors
    zero3-consolidate CHECKPOINT_DIR OUT.pt --prefix model.    # keep "model.*", strip the prefix
    zero3-consolidate CHECKPOINT_DIR OUT_DIR --format hf       # a Hugging Face model directory

The output is a plain ``state_dict`` under the model's own names (tied weights under each name), that
``model.load_state_dict(torch.load(OUT.pt, weights_only=True))`` takes with no zero3 installed.

[Note: streaming consolidation]
One process, no process group. For each tensor in turn: allocate it full, let DCP read every saved
piece of it into place, write its bytes to the output, free it. Peak memory is about the largest
tensor (twice, while DCP copies a piece in) over the process baseline, never the model. Every file of the
checkpoint is checked against its checksum by a helper thread while the tensors are read and written
(``verify.py``); the output is a staging file until the end, and the check is waited for before the last
tensor is handed to the writer, so a bad file leaves no output. The files are
written tensor by tensor by ``export/writers.py`` (safetensors: header first; torch format: the pickle first,
then one zip record per tensor, each with its true CRC).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Iterator, Optional, Union

import torch

from ..engine.memory.buffers import host_buffer, return_free_heap
from .atomic import read_manifest
from .dcp_io import FlatPiece, load_pieces
from ..export.hf import DEFAULT_MAX_SHARD, HF_CONFIG, write_hf_directory
from .sharded import MODEL_PREFIX
from ..export.writers import TensorEntry, write_safetensors, write_torch
from .verify import READ_FAILURES, BackgroundCheck, check_in_background, raise_if_bad


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


class _Entry(TensorEntry):
    """A tensor of the checkpoint: ``names[0]`` is the saved key; parameters are saved as flat pieces."""

    def __init__(self, names: list[str], shape: list[int], dtype: str, is_param: bool) -> None:
        super().__init__(names, list(shape), _dtype(dtype))
        self.is_param = is_param
        self.saved_name = names[0]


def _entries(manifest: dict, prefix: str) -> list[_Entry]:
    entries = [_Entry([name, *p["aliases"]], p["shape"], p["dtype"], True) for name, p in manifest["params"].items()]
    entries += [_Entry([name], b["shape"], b["dtype"], False) for name, b in manifest["buffers"].items()]
    for entry in entries:
        entry.names = [n.removeprefix(prefix) for n in entry.names if n.startswith(prefix)]
    return [e for e in entries if e.names]


def _read_full(path: Path, entry: _Entry) -> torch.Tensor:
    """One tensor, whole, read from every rank's pieces (this process alone). It is a memory map of its
    own, handed back to the kernel when the writer drops it: from glibc's heap, each freed tensor left a
    hole that the small allocations of the next read carve up, and the peak would grow by several tensors,
    varying from run to run."""
    full = host_buffer(entry.numel, entry.dtype)
    target = FlatPiece(full, 0, entry.numel) if entry.is_param else full.view(entry.shape)
    load_pieces({MODEL_PREFIX + entry.saved_name: target}, path, collective=False)
    return full


def _tensors(path: Path, entries: list[_Entry], check: Optional[BackgroundCheck]) -> Iterator[torch.Tensor]:
    """Each entry's full tensor in turn; with ``check``, a bad file stops the reads as soon as it is found,
    and the last tensor is handed over only once every file has passed."""
    for index, entry in enumerate(entries):
        if check is not None and check.failed():
            raise_if_bad(path, check)
        # The read's own temporaries (the bytes DCP read, at the tensor's size) come from glibc's heap once
        # its mmap threshold has risen to that size, and their freed space stays resident: the peak would
        # still vary by run. Handing the heap's free
        # pages back before each read bounds it by one read's temporaries.
        return_free_heap()
        tensor = _read_full(path, entry)
        if check is not None and index == len(entries) - 1:
            raise_if_bad(path, check)
        yield tensor


def consolidate_checkpoint(
    checkpoint: Path, out: Path, fmt: Optional[str] = None, prefix: Optional[str] = None,
    config: Optional[Path] = None, max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD, verify: bool = True,
) -> Path:
    """Write the full weights of the sharded ``checkpoint`` to ``out``: ``"pt"`` or ``"safetensors"`` (one file),
    or ``"hf"`` (a Hugging Face model directory, see ``export/hf.py``); by default from the suffix, and ``"hf"`` for a
    path without one when the checkpoint was written from a module that wraps a Hugging Face model. Only the
    names under ``prefix`` are kept, with the prefix removed (for ``"hf"``, by default the wrapped model's
    prefix). ``config``: a ``config.json`` for ``"hf"`` (by default the one the checkpoint carries). Every file
    of the checkpoint is checked against its checksum before the output appears (not with ``verify=False``,
    for measuring that)."""
    checkpoint, out = Path(checkpoint), Path(out)
    manifest = read_manifest(checkpoint)
    check = check_in_background(checkpoint, manifest) if verify else None
    try:
        return _consolidate(checkpoint, manifest, out, fmt, prefix, config, max_shard_size, check)
    except READ_FAILURES as failure:
        if check is None:
            raise
        error = failure
    raise_if_bad(checkpoint, check)  # a bad file explains a failed read better than the read's own error
    raise error


def _consolidate(
    checkpoint: Path, manifest: dict, out: Path, fmt: Optional[str], prefix: Optional[str], config: Optional[Path],
    max_shard_size: Union[int, str], check: Optional[BackgroundCheck],
) -> Path:
    carried = checkpoint / HF_CONFIG
    fmt = fmt or ("safetensors" if out.suffix == ".safetensors" else "pt" if out.suffix or not carried.is_file() else "hf")
    if fmt not in ("pt", "safetensors", "hf"):
        raise ValueError(f"zero3: unknown output format {fmt!r}; use 'pt', 'safetensors' or 'hf'.")
    configuration = None
    if fmt == "hf":
        configuration = _hf_configuration(checkpoint, carried, config)
        if prefix is None:
            prefix = configuration.get("prefix", "")
    entries = _entries(manifest, prefix or "")
    if not entries:
        raise ValueError(f"zero3: no tensor of {checkpoint} has a name starting with {prefix!r}.")
    if configuration is not None:
        return write_hf_directory(out, entries, _tensors(checkpoint, entries, check), configuration, max_shard_size)
    staging = out.with_name(f".{out.name}.partial")
    writer = write_safetensors if fmt == "safetensors" else write_torch
    try:
        writer(staging, entries, _tensors(checkpoint, entries, check))
        staging.replace(out)  # the output appears whole or not at all
    finally:
        staging.unlink(missing_ok=True)
    return out


def _hf_configuration(checkpoint: Path, carried: Path, config: Optional[Path]) -> dict:
    if config is not None:
        return {"config": json.loads(Path(config).read_text())}
    if not carried.is_file():
        raise ValueError(
            f"zero3: {checkpoint} was not written from a module that wraps a Hugging Face model, so it carries "
            "no configuration; pass the model's config.json (--config) to write a Hugging Face directory."
        )
    return json.loads(carried.read_text())


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="zero3-consolidate", description="Write the full weights of a zero3 sharded checkpoint."
    )
    parser.add_argument("checkpoint", type=Path, help="the sharded checkpoint directory")
    parser.add_argument("out", type=Path, help="output: a .pt (torch.save) or .safetensors file, or a directory (hf)")
    parser.add_argument("--format", choices=["pt", "safetensors", "hf"], help="default: from the output's suffix")
    parser.add_argument("--prefix", help="keep only names starting with this, and strip it (e.g. 'model.')")
    parser.add_argument("--config", type=Path, help="hf: the model's config.json (default: the checkpoint's own)")
    parser.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD, help="hf: split files above this (e.g. 5GB)")
    args = parser.parse_args(argv)
    out = consolidate_checkpoint(args.checkpoint, args.out, args.format, args.prefix, args.config, args.max_shard_size)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
