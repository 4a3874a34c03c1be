"""Real text that every machine has offline: the Python standard library's own source files, as bytes.

``stdlib_corpus`` concatenates ``*.py`` files of the running interpreter's standard library (sorted, so
every rank and every run reads the same bytes) and ``ByteWindows`` cuts it into next-byte prediction
samples for a byte-level GPT (vocabulary 256); ``StdlibText`` serves them to a Trainer (train and
validation splits), for the YAML configs of ``lightning-zero3``.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, Subset


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


class StdlibText(pl.LightningDataModule):
    """The standard library's sources as next-byte prediction windows.

    Args:
        block_size: Bytes per sample (the model's context length).
        batch_size: Samples per batch, per rank.
        corpus_bytes: How many bytes of sources to read.
        val_fraction: Share of the windows (taken first) held out for validation.
    """

    def __init__(
        self, block_size: int = 128, batch_size: int = 8, corpus_bytes: int = 4_000_000, val_fraction: float = 0.02
    ) -> None:
        super().__init__()
        if not 0 < val_fraction < 1:
            raise ValueError(f"StdlibText: `val_fraction` must be between 0 and 1, got {val_fraction!r}.")
        self.block_size, self.batch_size = block_size, batch_size
        self.corpus_bytes, self.val_fraction = corpus_bytes, val_fraction

    def setup(self, stage: str) -> None:
        windows = ByteWindows(stdlib_corpus(self.corpus_bytes), self.block_size)
        n_val = max(int(len(windows) * self.val_fraction), self.batch_size)
        self.train = Subset(windows, range(n_val, len(windows)))
        self.val = Subset(windows, range(n_val))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.batch_size)
