"""The user's own fine-tuning data: a jsonl file tokenized by the checkpoint's own tokenizer.

Each line is one JSON object, in one of three forms (a file may mix them):

- ``{"text": "..."}``: plain text; every token is trained.
- ``{"instruction": "...", "input": "...", "output": "..."}`` (Alpaca; ``input`` may be empty or absent):
  the prompt is ``instruction`` (and ``input``) in the Alpaca template; only ``output`` is trained.
- ``{"messages": [{"role": "user", "content": "..."}, ..., {"role": "assistant", "content": "..."}]}``:
  formatted by the tokenizer's chat template; only the last (assistant) message is trained.

Labels follow the field's convention: positions not trained are -100 (the prompt, and padding). Rows are
right-padded to the longest in the batch with the tokenizer's pad token (its EOS when it has none), with
an attention mask of 0 there; rows longer than ``max_length`` are cut. A bad row fails with the file, the
line number and what is wrong, before anything trains. The last ``val_fraction`` of the rows (at least
one) is the validation split.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

IGNORE = -100
ALPACA_PROMPT = "Below is an instruction that describes a task. Write a response that completes the request.\n\n### Instruction:\n{instruction}\n\n{input}### Response:\n"  # fmt: skip


class DataFormatError(ValueError):
    """A row of the data file is not one of the forms ``sft_data`` reads."""


def read_rows(path: Path) -> list[tuple[int, dict]]:
    """The rows of a jsonl file with their line numbers, each checked to be one of the three forms."""
    rows = []
    with open(path, encoding="utf-8") as stream:
        for number, line in enumerate(stream, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as failure:
                raise DataFormatError(f"{path}:{number}: not valid JSON ({failure})") from None
            problem = _problem(row)
            if problem:
                raise DataFormatError(f"{path}:{number}: {problem}")
            rows.append((number, row))
    if not rows:
        raise DataFormatError(f"{path}: holds no rows")
    return rows


def _problem(row: Any) -> Optional[str]:
    if not isinstance(row, dict):
        return f"a row must be a JSON object, not {type(row).__name__}"
    if "text" in row:
        return None if isinstance(row["text"], str) and row["text"] else "'text' must be a non-empty string"
    if "instruction" in row or "output" in row:
        for key in ("instruction", "output"):
            if not isinstance(row.get(key), str) or not row[key]:
                return f"an instruction row needs a non-empty string {key!r} (it has {sorted(row)})"
        if not isinstance(row.get("input", ""), str):
            return "'input' must be a string"
        return None
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages:
            return "'messages' must be a non-empty list"
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
                return f"messages[{i}] must be an object with string 'role' and 'content'"
        if messages[-1]["role"] != "assistant":
            return f"the last message must be the assistant's (the response trained on), not {messages[-1]['role']!r}"
        return None
    return f"a row needs 'text', 'instruction'/'output', or 'messages'; it has {sorted(row)}"


def tokenize(row: dict, tokenizer: Any, max_length: int) -> tuple[list[int], list[int]]:
    """Token ids and labels of one row (the prompt's labels -100)."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if "text" in row:
        ids = tokenizer(row["text"], add_special_tokens=True)["input_ids"] + eos
        return ids[:max_length], ids[:max_length]
    if "messages" in row:
        prompt = _ids(tokenizer.apply_chat_template(row["messages"][:-1], add_generation_prompt=True, tokenize=True))
        full = _ids(tokenizer.apply_chat_template(row["messages"], tokenize=True))
        if full[: len(prompt)] != prompt:
            raise DataFormatError("the chat template formats the conversation without its prompt as a prefix")
        ids, start = full, len(prompt)
    else:
        text = ALPACA_PROMPT.format(instruction=row["instruction"], input=f"{row['input']}\n\n" if row.get("input") else "")
        prompt = tokenizer(text, add_special_tokens=True)["input_ids"]
        ids = prompt + tokenizer(row["output"], add_special_tokens=False)["input_ids"] + eos
        start = len(prompt)
    labels = [IGNORE] * start + ids[start:]
    return ids[:max_length], labels[:max_length]


def _ids(out: Any) -> list[int]:
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


def collate(rows: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` (0 on padding) and ``labels`` (-100 on padding)."""
    longest = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), longest), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, (row_ids, row_labels) in enumerate(rows):
        ids[i, : len(row_ids)] = torch.tensor(row_ids)
        labels[i, : len(row_labels)] = torch.tensor(row_labels)
        mask[i, : len(row_ids)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class JsonlInstructions(pl.LightningDataModule):
    """A jsonl file of text, Alpaca or chat rows, tokenized by the checkpoint's ``AutoTokenizer``.

    Args:
        path: The jsonl file.
        tokenizer: The tokenizer's directory (None: the model's ``checkpoint``).
        max_length: Tokens per row at most (longer rows are cut).
        batch_size: Rows per batch on each rank.
        val_fraction: The share of rows (the last ones, at least one) kept for validation.
        make_sample: Write a small sample file at ``path`` first if there is none (no download).
    """

    def __init__(self, path: str, tokenizer: Optional[str] = None, max_length: int = 512, batch_size: int = 4,
                 val_fraction: float = 0.1, make_sample: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.path, self.tokenizer_dir, self.max_length = Path(path), tokenizer, max_length
        self.batch_size, self.val_fraction, self.make_sample = batch_size, val_fraction, make_sample
        self.train: list = []
        self.val: list = []

    def prepare_data(self) -> None:
        if self.make_sample and not self.path.is_file():
            try:
                from examples.finetune_assets import write_sample_data
            except ImportError:  # run with examples/ itself on the path
                from finetune_assets import write_sample_data

            write_sample_data(self.path)

    def setup(self, stage: str) -> None:
        from transformers import AutoTokenizer

        directory = self.tokenizer_dir or getattr(self.trainer.lightning_module, "checkpoint", None)
        tokenizer = AutoTokenizer.from_pretrained(directory)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        examples = []
        for number, row in read_rows(self.path):
            try:
                examples.append(tokenize(row, tokenizer, self.max_length))
            except DataFormatError as failure:
                raise DataFormatError(f"{self.path}:{number}: {failure}") from None
        held = max(1, int(len(examples) * self.val_fraction)) if len(examples) > 1 else 0
        self.train, self.val = examples[: len(examples) - held], examples[len(examples) - held :]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True, collate_fn=self._collate, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.batch_size, collate_fn=self._collate)

    def _collate(self, rows):
        return collate(rows, self.pad_id)
