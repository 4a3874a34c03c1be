"""The fine-tuning data (``examples/sft_data.py``): text, Alpaca and chat rows tokenized by a subword tokenizer
trained locally, the prompt masked with -100, right padding with its attention mask, and bad rows refused
with the file, the line and what is wrong."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from examples.finetune_assets import train_tokenizer, write_sample_data  # noqa: E402
from examples.sft_data import IGNORE, DataFormatError, collate, read_rows, tokenize  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(directory)
    return transformers.AutoTokenizer.from_pretrained(directory)


def test_only_the_response_is_trained_and_padding_is_masked(tokenizer, tmp_path):
    rows = [row for _, row in read_rows(write_sample_data(tmp_path / "data.jsonl"))][:3]  # alpaca, chat, text
    examples = [tokenize(row, tokenizer, 256) for row in rows]
    for (ids, labels), row in zip(examples[:2], rows[:2]):
        trained = tokenizer.decode([i for i, label in zip(ids, labels) if label != IGNORE])
        assert trained.strip() == "The sky is blue on a clear day.</s>", row
        assert labels[0] == IGNORE
    ids, labels = examples[2]
    assert labels == ids  # plain text: every token
    batch = collate(examples, tokenizer.pad_token_id)
    lengths = [len(ids) for ids, _ in examples]
    assert batch["attention_mask"].sum(1).tolist() == lengths
    for i, n in enumerate(lengths):
        assert (batch["labels"][i, n:] == IGNORE).all() and (batch["input_ids"][i, n:] == tokenizer.pad_token_id).all()


@pytest.mark.parametrize("line, message", [
    ("{not json", r"data\.jsonl:2: not valid JSON"),
    (json.dumps({"instruction": "Hi"}), r"data\.jsonl:2: an instruction row needs a non-empty string 'output'"),
    (json.dumps({"messages": [{"role": "user", "content": "Hi"}]}), r"data\.jsonl:2: the last message must be the assistant's"),
    (json.dumps({"prompt": "x"}), r"data\.jsonl:2: a row needs 'text', 'instruction'/'output', or 'messages'; it has \['prompt'\]"),
])  # fmt: skip
def test_a_bad_row_names_the_file_the_line_and_the_problem(tmp_path, line, message):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + line + "\n")
    with pytest.raises(DataFormatError, match=message):
        read_rows(path)
