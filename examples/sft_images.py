"""Image conversations for a vision-language model: a jsonl file processed by the checkpoint's own processor.

Each line is a chat row of ``sft_data.py`` with an image:

    {"image": "images/cat.png", "messages": [{"role": "user", "content": "<image>\\nWhat is this?"},
                                             {"role": "assistant", "content": "A cat."}]}

``image`` is a path, relative to the jsonl file's directory unless absolute. The conversation is formatted
by the tokenizer's chat template; the processor (``AutoProcessor`` from the checkpoint) turns ``<image>``
into as many image tokens as the model makes features of that image (a message without ``<image>`` gets
one before the first user message's text), and the image into ``pixel_values`` and ``image_sizes``. Only
the last (assistant) message is trained: the prompt and its image tokens get the label -100. Rows are
right-padded as ``sft_data.collate`` pads them; ``pixel_values`` are padded with zero tiles to the most
tiles of the batch (LLaVA-Next's any-resolution images differ in tile count; the model keeps each image's
own, from ``image_sizes``). Sampling, resume, ``group_by_length`` and the validation split are
``JsonlInstructions``'. Rows are not packed: each row's image features are placed by its own image tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

try:
    from examples.sft_data import (
        IGNORE,
        DataFormatError,
        JsonlInstructions,
        collate,
        read_rows,
    )
except ImportError:  # run with examples/ itself on the path
    from sft_data import IGNORE, DataFormatError, JsonlInstructions, collate, read_rows

#: where the sample rows (and their images, in ``images/`` beside it) are written when no ``path`` is given
SAMPLE_IMAGE_DATA = "runs/data-images/sample.jsonl"
IMAGE = "<image>"


def process(row: dict, base: Path, processor: Any, max_length: int) -> dict:
    """One row's ``input_ids``, ``labels`` (lists) and ``pixel_values``, ``image_sizes`` (tensors)."""
    from PIL import Image

    image_path = row.get("image")
    if not isinstance(image_path, str) or not image_path:
        raise DataFormatError(f"an image row needs a string 'image' (a path) and 'messages' (it has {sorted(row)})")
    if "messages" not in row:
        raise DataFormatError(f"an image row needs 'messages', a conversation (it has {sorted(row)})")
    file = Path(image_path) if Path(image_path).is_absolute() else base / image_path
    try:
        image = Image.open(file).convert("RGB")
    except OSError as failure:
        raise DataFormatError(f"cannot read the image {file} ({failure})") from None
    messages = [dict(m) for m in row["messages"]]
    if not any(IMAGE in m["content"] for m in messages):
        first = next(m for m in messages if m["role"] == "user")
        first["content"] = f"{IMAGE}\n{first['content']}"
    template = processor.tokenizer.apply_chat_template
    prompt = processor(images=image, text=template(messages[:-1], add_generation_prompt=True, tokenize=False))
    full = processor(images=image, text=template(messages, tokenize=False), return_tensors="pt")
    ids, start = full["input_ids"][0].tolist(), len(prompt["input_ids"][0])
    if ids[:start] != list(prompt["input_ids"][0]):
        raise DataFormatError("the chat template formats the conversation without its prompt as a prefix")
    if start >= max_length:
        raise DataFormatError(
            f"the prompt with its image tokens is {start} tokens, max_length {max_length} leaves no response"
        )
    labels = [IGNORE] * start + ids[start:]
    return {"input_ids": ids[:max_length], "labels": labels[:max_length],
            "pixel_values": full["pixel_values"][0], "image_sizes": full["image_sizes"][0]}  # fmt: skip


def collate_images(rows: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """``sft_data.collate``'s padded text, with ``pixel_values`` (batch, tiles, 3, H, W) padded with zero
    tiles to the most tiles of the batch, and ``image_sizes`` (batch, 2)."""
    batch = collate([(row["input_ids"], row["labels"]) for row in rows], pad_id)
    most = max(row["pixel_values"].shape[0] for row in rows)
    pixels = torch.zeros((len(rows), most, *rows[0]["pixel_values"].shape[1:]), dtype=rows[0]["pixel_values"].dtype)
    for i, row in enumerate(rows):
        pixels[i, : row["pixel_values"].shape[0]] = row["pixel_values"]
    batch["pixel_values"] = pixels
    batch["image_sizes"] = torch.stack([row["image_sizes"] for row in rows])
    return batch


class ImageConversations(JsonlInstructions):
    """A jsonl file of image + conversation rows, processed by the checkpoint's ``AutoProcessor``.

    Args:
        path: The jsonl file (None: a small sample with generated images, written once at ``SAMPLE_IMAGE_DATA``).
        processor: The processor's directory (None: the model's ``checkpoint``).
        max_length: Tokens per row at most, the image's tokens included (longer rows are cut in the response).
        batch_size: Rows per batch on each rank.
        val_fraction: The share of rows (the last ones, at least one) kept for validation.
        group_by_length: Batches of rows of similar length (image tokens included), in shuffled order: less
            padding (``sft_data.LengthGroupedSampler``).
    """

    def __init__(self, path: Optional[str] = None, processor: Optional[str] = None, max_length: int = 512,
                 batch_size: int = 4, val_fraction: float = 0.1, group_by_length: bool = False) -> None:  # fmt: skip
        super().__init__(path or SAMPLE_IMAGE_DATA, processor, max_length, batch_size, val_fraction,
                         group_by_length=group_by_length)  # fmt: skip
        self.sample = path is None

    SAMPLE_WRITER = "write_sample_images"  # prepare_data (JsonlInstructions') writes images and rows

    def setup(self, stage: str) -> None:
        from transformers import AutoProcessor

        if not self.path.is_file():
            raise FileNotFoundError(f"ImageConversations: no data file at {self.path}")
        directory = self.tokenizer_dir or getattr(self.trainer.lightning_module, "checkpoint", None)
        processor = AutoProcessor.from_pretrained(directory)
        tokenizer = processor.tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        examples = []
        for number, row in read_rows(self.path):
            try:
                examples.append(process(row, self.path.parent, processor, self.max_length))
            except DataFormatError as failure:
                raise DataFormatError(f"{self.path}:{number}: {failure}") from None
        held = max(1, int(len(examples) * self.val_fraction)) if len(examples) > 1 else 0
        self.train, self.val = examples[: len(examples) - held], examples[len(examples) - held :]

    def lengths(self) -> list[int]:
        return [len(row["input_ids"]) for row in self.train]

    def _collate(self, rows):
        return collate_images(rows, self.pad_id)
