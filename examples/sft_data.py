"""The user's own fine-tuning data: a jsonl file tokenized by the checkpoint's own tokenizer.

Each line is one JSON object, in one of three forms (a file may mix them):

- ``{"text": "..."}``: plain text; every token is trained.
- ``{"instruction": "...", "input": "...", "output": "..."}`` (Alpaca; ``input`` may be empty or absent):
  the prompt is ``instruction`` (and ``input``) in the Alpaca template; only ``output`` is trained.
- ``{"messages": [{"role": "user", "content": "..."}, ..., {"role": "assistant", "content": "..."}]}``:
  formatted by the tokenizer's chat template; only the last (assistant) message is trained.

Labels follow the field's convention: positions not trained are -100 (the prompt, and padding). Rows are
right-padded to the longest in the batch with the tokenizer's pad token (its EOS when it has none), with
an attention mask of 0 there; rows longer than ``max_length`` are cut. With ``packing`` whole rows are
concatenated into packs of up to ``max_length`` tokens instead (see [Note: packed rows]); with
``group_by_length`` each batch holds rows of similar length (``LengthGroupedSampler``). A bad row fails
with the file, the line number and what is wrong, before anything trains. The last ``val_fraction`` of
the rows (at least one) is the validation split. With no ``path`` given, a small sample file is written
(once) at ``SAMPLE_DATA`` and trained on; a ``path`` that is given must exist and is only read.

[Note: resuming mid-epoch]
The training rows are shuffled per epoch as Lightning's own distributed sampler shuffles them (the
``seed_everything`` seed plus the epoch, so every rank agrees), by a sampler made here rather than
injected by Lightning, so that on ``--ckpt_path`` it can start after the batches the checkpoint already
trained on. Lightning restores its loops before it asks for the dataloader, so the number of batches this
epoch has processed (``batch_progress.current.processed``, whether the checkpoint was written after a
batch or after validation) is known there; the loader's ``state_dict`` interface only tells Lightning that
it resumes (a loader without it makes Lightning warn, and replay the epoch from its first batch).

[Note: packed rows]
``pack`` fills packs greedily in the file's order: a row goes into the current pack while the pack stays
within ``max_length`` tokens, else it starts the next pack. Every row is first cut to ``max_length`` as
without packing, so a row is never split across two packs. The packs are made once, identically on every
rank, and are the dataset's items: the sampler shuffles, shares out and resumes them as it does rows.
In a packed batch the position ids restart at 0 at each row (and at the padding after the last row), and
there is no attention mask: transformers then derives a block-causal mask from the restarts
(``masking_utils.find_packed_sequence_indices``, for sdpa, eager and flex attention), so a token sees only
the earlier tokens of its own row, at the positions it has alone. It does so only without a KV cache, and
a model whose config has ``use_cache`` (the default) makes one even in training unless the forward says
``use_cache=False``, as ``CausalLMFineTune.batch_loss`` does; with a cache the rows would silently attend
across their boundaries. Flash-attention reads the same restarts, but only in a batch of one row
(``modeling_flash_attention_utils._is_packed_sequence``), so for it a batch's packs are laid end to end in
one row. Each row's first label is -100: no row's first token is predicted from the previous row's last, so
every row trains the tokens it trains alone, and the loss over the trained tokens of all ranks is unchanged.
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


def pack(examples: list[tuple[list[int], list[int]]], max_length: int) -> list[list[tuple[list[int], list[int]]]]:
    """Rows (each at most ``max_length`` tokens), in order, into packs of at most ``max_length`` tokens, a row
    never split (see [Note: packed rows])."""
    packs: list = []
    used = max_length + 1  # no pack open yet
    for row in examples:
        if used + len(row[0]) > max_length:
            packs.append([])
            used = 0
        packs[-1].append(row)
        used += len(row[0])
    return packs


def collate_packed(packs: list[list[tuple[list[int], list[int]]]], pad_id: int, one_row: bool = False) -> dict[str, torch.Tensor]:
    """``input_ids``, ``position_ids`` (restarting at 0 at each row and at the padding) and ``labels`` (-100 on
    each row's first token and on padding) of packs right-padded to the longest pack; no attention mask.
    ``one_row``: the packs laid end to end in a single row (flash-attention's layout), with no padding."""
    lengths = [sum(len(ids) for ids, _ in rows) for rows in packs]
    if one_row:
        packs, lengths = [[row for rows in packs for row in rows]], [sum(lengths)]
    longest = max(lengths)
    ids = torch.full((len(packs), longest), pad_id, dtype=torch.long)
    labels = torch.full((len(packs), longest), IGNORE, dtype=torch.long)
    positions = torch.zeros((len(packs), longest), dtype=torch.long)
    for i, rows in enumerate(packs):
        at = 0
        for row_ids, row_labels in rows:
            n = len(row_ids)
            ids[i, at : at + n] = torch.tensor(row_ids)
            labels[i, at + 1 : at + n] = torch.tensor(row_labels[1:], dtype=torch.long)
            positions[i, at : at + n] = torch.arange(n)
            at += n
        positions[i, at:] = torch.arange(longest - at)
    return {"input_ids": ids, "position_ids": positions, "labels": labels}


#: attention implementations of transformers that keep each packed row to itself from restarting position
#: ids alone (see [Note: packed rows]); flash-attention's only with the packs in one row
MASKED_FROM_POSITIONS = ("sdpa", "eager", "flex_attention")
VARLEN_FROM_POSITIONS = ("flash_attention_2", "flash_attention_3")


class PackingError(ValueError):
    """``packing: true`` with a model whose attention would let packed rows see each other."""


def packed_layout(module: torch.nn.Module) -> bool:
    """Whether packed batches for ``module``'s Hugging Face model go in one row (flash-attention) or one row
    per pack (sdpa, eager, flex); raises ``PackingError`` if its attention cannot keep packed rows apart."""
    try:
        from transformers.masking_utils import find_packed_sequence_indices  # noqa: F401
    except ImportError:
        raise PackingError(
            "packing: true needs a transformers whose attention masks follow restarting position ids "
            "(transformers.masking_utils.find_packed_sequence_indices); upgrade transformers, "
            "or set --data.init_args.packing false (group_by_length: true also removes most padding)."
        ) from None
    config = next((m.config for m in module.modules() if hasattr(getattr(m, "config", None), "_attn_implementation")), None)
    if config is None:
        raise PackingError("packing: true needs a Hugging Face model (one with a config naming its attention); "
                           "set --data.init_args.packing false for this model.")  # fmt: skip
    implementation = config._attn_implementation
    if implementation in VARLEN_FROM_POSITIONS:
        return True
    if implementation in MASKED_FROM_POSITIONS:
        return False
    raise PackingError(
        f"packing: true cannot keep packed rows apart with the model's attention implementation "
        f"{implementation!r} (config._attn_implementation): only {', '.join(MASKED_FROM_POSITIONS + VARLEN_FROM_POSITIONS)} "
        "derive each row's attention from its position ids. Load the model with one of those "
        "(attn_implementation=...), or set --data.init_args.packing false."
    )


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
        indices = self.epoch_indices()
        skip, self.skip = self.skip, 0  # the first epoch after a resume only
        return iter(indices[skip:])

    def epoch_indices(self) -> list[int]:
        """This rank's indices of the epoch (``set_epoch``'s), in order."""
        return list(super().__iter__())


class LengthGroupedSampler(ResumingSampler):
    """``ResumingSampler``'s resumable epochs, with batches of rows of similar length: each epoch the rows are
    shuffled (the global seed plus the epoch, the same on every rank), sorted by length within windows of
    ``WINDOW`` global batches (a global batch: ``batch_size`` rows for each rank), cut into global batches,
    and the global batches shuffled, so that neither the longest nor the shortest rows come first. Rank r
    takes rows ``r * batch_size`` to ``(r + 1) * batch_size`` of each global batch, so every rank's batch at a
    step has about the same lengths. The rows left over from whole global batches (fewer than one) sit out
    that epoch, as the loader's ``drop_last`` drops them unsorted."""

    WINDOW = 64

    def __init__(self, lengths: list[int], batch_size: int, num_replicas: int, rank: int, seed: int) -> None:
        super().__init__(lengths, num_replicas=num_replicas, rank=rank, seed=seed)
        self.lengths, self.batch_size = lengths, batch_size
        self.num_samples = len(lengths) // (batch_size * num_replicas) * batch_size
        self.total_size = self.num_samples * num_replicas

    def epoch_indices(self) -> list[int]:
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.lengths), generator=generator).tolist()[: self.total_size]
        width = self.batch_size * self.num_replicas
        batches = []
        for start in range(0, len(order), width * self.WINDOW):
            window = sorted(order[start : start + width * self.WINDOW], key=lambda i: -self.lengths[i])
            batches += [window[at : at + width] for at in range(0, len(window), width)]
        mine = slice(self.rank * self.batch_size, (self.rank + 1) * self.batch_size)
        return [i for b in torch.randperm(len(batches), generator=generator).tolist() for i in batches[b][mine]]


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
        batch_size: Rows per batch on each rank (with ``packing``: packs per batch).
        val_fraction: The share of rows (the last ones, at least one) kept for validation.
        packing: Concatenate whole rows into packs of up to ``max_length`` tokens, each row attending only to
            itself (see [Note: packed rows]): no compute spent on padding. Not for data whose rows must see
            each other.
        group_by_length: Batches of rows of similar length, in shuffled order (``LengthGroupedSampler``):
            less padding where rows cannot be packed.
    """

    def __init__(self, path: Optional[str] = None, tokenizer: Optional[str] = None, max_length: int = 512,
                 batch_size: int = 4, val_fraction: float = 0.1, packing: bool = False,
                 group_by_length: bool = False) -> None:  # fmt: skip
        super().__init__()
        if packing and group_by_length:
            raise ValueError(
                f"{type(self).__name__}: set packing or group_by_length, not both: packing already fills each batch "
                "with whole rows up to max_length; group_by_length is for rows that cannot be packed."
            )
        self.packing, self.group_by_length = packing, group_by_length
        self.one_row = False  # the packs of a batch in one row (flash-attention: see [Note: packed rows])
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
        if self.packing:
            self.train, self.val = pack(self.train, self.max_length), pack(self.val, self.max_length)

    def lengths(self) -> list[int]:
        """The tokens of each training row (``group_by_length`` sorts by them)."""
        return [len(ids) for ids, _ in self.train]

    def largest_sample_index(self) -> int:
        """The training item of the most tokens: zero3's automatic offload plan sizes the activations to a
        batch of it (``memory_budget``), so later, longer batches fit the plan taken at setup."""
        sizes = [sum(len(ids) for ids, _ in item) for item in self.train] if self.packing else self.lengths()
        return max(range(len(sizes)), key=sizes.__getitem__, default=0)

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer
        self._check_packing()
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        if self.group_by_length:
            sampler = LengthGroupedSampler(self.lengths(), self.batch_size, trainer.world_size, trainer.global_rank, seed)
        else:
            sampler = ResumingSampler(self.train, num_replicas=trainer.world_size, rank=trainer.global_rank, seed=seed)
        def batches_done() -> int:  # read when a checkpoint is written
            return trainer.fit_loop.epoch_loop.batch_progress.current.processed

        loader = ResumableLoader(self.train, batch_size=self.batch_size, sampler=sampler, collate_fn=self._collate,
                                 drop_last=True, batches_done=batches_done)  # fmt: skip
        if len(loader) == 0:
            items = f"{len(self.train)} packs of up to {self.max_length} tokens" if self.packing else f"{len(self.train)} rows"
            raise ValueError(
                f"{type(self).__name__}: the training split holds {items}, fewer than one batch of batch_size "
                f"{self.batch_size} on each of {trainer.world_size} ranks: lower --data.init_args.batch_size, or give more rows."
            )
        return loader

    def val_dataloader(self) -> DataLoader:
        self._check_packing()
        return DataLoader(self.val, batch_size=self.batch_size, collate_fn=self._collate)

    def _check_packing(self) -> None:
        """With ``packing``, refuse a model whose attention would mix packed rows, and choose the layout its
        attention reads. Lightning configures the model before it asks for a loader."""
        if self.packing:
            self.one_row = packed_layout(self.trainer.lightning_module)

    def _collate(self, rows):
        return collate_packed(rows, self.pad_id, self.one_row) if self.packing else collate(rows, self.pad_id)
