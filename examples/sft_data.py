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
one) is the validation split. With no ``path`` given, a small sample file is written (once) at
``SAMPLE_DATA`` and trained on; a ``path`` that is given must exist and is only read.

[Note: resuming mid-epoch]
The training rows are shuffled per epoch as Lightning's own distributed sampler shuffles them (the
``seed_everything`` seed plus the epoch, so every rank agrees), by a sampler made here rather than
injected by Lightning, so that on ``--ckpt_path`` it can start after the batches the checkpoint already
trained on. Lightning restores its loops before it asks for the dataloader, so the number of batches this
epoch has processed (``batch_progress.current.processed``, whether the checkpoint was written after a
batch or after validation) is known there; the loader's ``state_dict`` interface only tells Lightning that
it resumes (a loader without it makes Lightning warn, and replay the epoch from its first batch).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator, Optional

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, DistributedSampler

#: where the sample rows are written when no ``path`` is given (relative to the working directory)
SAMPLE_DATA = "runs/data/sample.jsonl"
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


class ResumingSampler(DistributedSampler):
    """Lightning's distributed shuffle (``shuffle=True``, the global seed, reshuffled by ``set_epoch``) that
    leaves out the first ``skip`` indices of the next epoch it serves: the rows a resumed run has already
    trained on (see [Note: resuming mid-epoch]). Its length stays the epoch's, as Lightning counts it."""

    def __init__(self, dataset, num_replicas: int, rank: int, seed: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        self.skip = 0

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        skip, self.skip = self.skip, 0  # the first epoch after a resume only
        return iter(indices[skip:])


class ResumableLoader(DataLoader):
    """A DataLoader that Lightning treats as resumable (``state_dict`` / ``load_state_dict``): it starts
    after ``batches_done`` batches of the epoch, taken from the trainer's restored progress."""

    def __init__(self, *args: Any, batches_done: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._batches_done = batches_done  # a callable: this epoch's processed batches

    def state_dict(self) -> dict:
        return {"batches_done": int(self._batches_done())}

    def load_state_dict(self, state: dict) -> None:
        done = state["batches_done"]
        if 0 < done < len(self):  # a checkpoint at the epoch's end starts the next one whole
            self.sampler.skip = done * self.batch_size


class JsonlInstructions(pl.LightningDataModule):
    """A jsonl file of text, Alpaca or chat rows, tokenized by the checkpoint's ``AutoTokenizer``.

    Args:
        path: The jsonl file (None: a small sample, written once at ``SAMPLE_DATA``).
        tokenizer: The tokenizer's directory (None: the model's ``checkpoint``).
        max_length: Tokens per row at most (longer rows are cut).
        batch_size: Rows per batch on each rank.
        val_fraction: The share of rows (the last ones, at least one) kept for validation.
    """

    def __init__(self, path: Optional[str] = None, tokenizer: Optional[str] = None, max_length: int = 512,
                 batch_size: int = 4, val_fraction: float = 0.1) -> None:  # fmt: skip
        super().__init__()
        self.sample = path is None
        self.path = Path(path if path is not None else SAMPLE_DATA)
        self.tokenizer_dir, self.max_length = tokenizer, max_length
        self.batch_size, self.val_fraction = batch_size, val_fraction
        self.train: list = []
        self.val: list = []

    #: the ``finetune_assets`` function that writes the sample file when no ``path`` is given
    SAMPLE_WRITER = "write_sample_data"

    def prepare_data(self) -> None:
        if not self.sample or self.path.is_file():
            return
        try:
            from examples import finetune_assets
        except ImportError:  # run with examples/ itself on the path
            import finetune_assets

        staging = self.path.with_name(f".{self.path.name}.partial-{os.getpid()}")
        getattr(finetune_assets, self.SAMPLE_WRITER)(staging)
        os.replace(staging, self.path)

    def setup(self, stage: str) -> None:
        from transformers import AutoTokenizer

        if not self.path.is_file():
            raise FileNotFoundError(f"JsonlInstructions: no data file at {self.path}")
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
        trainer = self.trainer
        sampler = ResumingSampler(self.train, num_replicas=trainer.world_size, rank=trainer.global_rank,
                                  seed=int(os.environ.get("PL_GLOBAL_SEED", 0)))  # fmt: skip
        def batches_done() -> int:  # read when a checkpoint is written
            return trainer.fit_loop.epoch_loop.batch_progress.current.processed

        return ResumableLoader(self.train, batch_size=self.batch_size, sampler=sampler, collate_fn=self._collate,
                               drop_last=True, batches_done=batches_done)  # fmt: skip

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.batch_size, collate_fn=self._collate)

    def _collate(self, rows):
        return collate(rows, self.pad_id)
