"""Real text that every machine has offline: the Python standard library's own source files, as bytes.

``stdlib_corpus`` concatenates ``*.py`` files of the running interpreter's standard library (sorted, so
every rank and every run reads the same bytes) and ``ByteWindows`` cuts it into next-byte prediction
samples for a byte-level GPT (vocabulary 256).
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset


def stdlib_corpus(max_bytes: int = 4_000_000) -> torch.Tensor:
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    if not chunks:
        raise FileNotFoundError(f"no Python sources found under {root} to build the corpus from")
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()


class ByteWindows(Dataset):
    """Non-overlapping windows of ``block_size + 1`` bytes: input is the first ``block_size``, target the rest."""

    def __init__(self, corpus: torch.Tensor, block_size: int) -> None:
        self.corpus = corpus
        self.block_size = block_size

    def __len__(self) -> int:
        return (len(self.corpus) - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.block_size
        window = self.corpus[start : start + self.block_size + 1]
        return window[:-1], window[1:]
