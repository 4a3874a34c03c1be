"""What the fine-tuning jobs need when no checkpoint or data is given, made locally (nothing downloaded):
a subword (BPE) tokenizer trained with the ``tokenizers`` library on a small built-in corpus, with a chat
template, saved as a ``PreTrainedTokenizerFast`` next to the checkpoint; and a small jsonl file of
instruction, chat and text rows (``sft_data.py``'s three forms)."""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% if m['role'] == 'assistant' %}</s>{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
FACTS = [
    ("What colour is the sky on a clear day?", "The sky is blue on a clear day."),
    ("How many legs does a spider have?", "A spider has eight legs."),
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Name a fruit that is yellow.", "A banana is a yellow fruit."),
    ("What do bees make?", "Bees make honey."),
    ("How many days are in a week?", "There are seven days in a week."),
    ("What is frozen water called?", "Frozen water is called ice."),
    ("Which animal says moo?", "A cow says moo."),
]


def sample_rows() -> list[dict]:
    rows = []
    for question, answer in FACTS:
        rows.append({"instruction": question, "input": "", "output": answer})
        rows.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]})
        rows.append({"text": f"{question} {answer}"})
    return rows


def write_sample_data(path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in sample_rows()))
    return path


def train_tokenizer(directory: Path, vocab_size: int = 512):
    """A byte-level BPE tokenizer trained on the sample corpus, saved at ``directory``; returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<unk>", "<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>"]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [f"{q} {a}" for q, a in FACTS] * 4 + [json.dumps(r) for r in sample_rows()]
    corpus.append("Below is an instruction that describes a task. Write a response that completes the request. "
                  "### Instruction: ### Response:")  # fmt: skip
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tokenizer.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>")  # fmt: skip
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return fast


COLOURS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 60, 220), "yellow": (230, 210, 40)}


def write_sample_images(path: Path) -> Path:
    """A small jsonl of image conversations (``sft_images.py``'s rows) and its PNG images (drawn here with
    PIL, which the image processors need anyway), in ``images/`` beside the file: each image is one colour
    (with a darker band) at 32x32 or 32x64 pixels, and the assistant names the colour."""
    from PIL import Image

    path = Path(path)
    images = path.parent / "images"
    images.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, (name, rgb) in enumerate(COLOURS.items()):
        for height, width in ((32, 32), (32, 64)):
            image = Image.new("RGB", (width, height), rgb)
            image.paste(tuple(c // 2 for c in rgb), (0, height // 2, width, height // 2 + 4))
            file = images / f"{name}-{width}x{height}.png"
            image.save(file)
            for question in ("What colour is this picture?", "Describe the image."):
                rows.append({"image": f"images/{file.name}", "messages": [
                    {"role": "user", "content": f"<image>\n{question}"},
                    {"role": "assistant", "content": f"The picture is {name}."}]})  # fmt: skip
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
