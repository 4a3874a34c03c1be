"""The fine-tuning data (``examples/sft_data.py``): text, Alpaca and chat rows tokenized by a subword tokenizer
trained locally, the prompt masked with -100, right padding with its attention mask, and bad rows refused
with the file, the line and what is wrong."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from examples.finetune_assets import train_tokenizer, write_sample_data  # noqa: E402
from examples.sft_data import (  # noqa: E402
    IGNORE,
    DataFormatError,
    JsonlInstructions,
    LengthGroupedSampler,
    PackingError,
    ResumableLoader,
    ResumingSampler,
    collate,
    collate_packed,
    pack,
    packed_layout,
    read_rows,
    tokenize,
)


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


# -- packing and length grouping ----------------------------------------------------------------------------

FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}


def tiny_causal_lm(family: str, attention: str) -> torch.nn.Module:
    config_class, model_class = (getattr(transformers, name) for name in FAMILIES[family])
    config = config_class(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    config._attn_implementation = attention
    torch.manual_seed(0)
    return model_class(config).eval()


def random_rows(lengths: list[int], prompt: int = 3) -> list[tuple[list[int], list[int]]]:
    """Rows of random tokens, the first ``prompt`` of each not trained."""
    generator = torch.Generator().manual_seed(1)
    rows = []
    for n in lengths:
        ids = torch.randint(1, 64, (n,), generator=generator).tolist()
        rows.append((ids, [IGNORE] * min(prompt, n) + ids[prompt:]))
    return rows


def summed_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The summed loss of the trained tokens, each predicted from the position before it."""
    return F.cross_entropy(logits[:-1], labels[1:], ignore_index=IGNORE, reduction="sum")


def test_packs_hold_whole_rows_in_order_up_to_max_length():
    rows = random_rows([5, 7, 4, 16, 1, 9, 9])
    packs = pack(rows, 16)
    assert [[len(ids) for ids, _ in p] for p in packs] == [[5, 7, 4], [16], [1, 9], [9]]
    assert [row for p in packs for row in p] == rows  # every row once, whole, in order
    batch = collate_packed(packs[:3], pad_id=0)
    assert batch.keys() == {"input_ids", "position_ids", "labels"}  # no attention mask: see [Note: packed rows]
    assert batch["position_ids"][0].tolist() == [*range(5), *range(7), *range(4)]
    assert batch["position_ids"][2].tolist() == [0, *range(9), *range(6)]  # the padding restarts too
    assert (batch["labels"][0, [0, 5, 12]] == IGNORE).all()  # no row's first token is predicted from the row before
    trained_alone = sum((torch.tensor(labels[1:]) != IGNORE).sum() for p in packs[:3] for _, labels in p)
    assert (batch["labels"][:, 1:] != IGNORE).sum() == trained_alone
    flat = collate_packed(packs[:3], pad_id=0, one_row=True)
    assert flat["input_ids"].shape == (1, 42) and flat["position_ids"][0, 16:32].tolist() == list(range(16))


@pytest.mark.parametrize("one_row", [False, True], ids=["a-row-per-pack", "one-row"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_rows_loss_in_a_packed_batch_equals_its_loss_alone(family, attention, one_row):
    """The block-causal mask transformers derives from the restarting position ids keeps every row to itself
    (with no KV cache, as ``CausalLMFineTune.batch_loss`` runs): each row's summed loss (and its logits) in
    the packed batch are the row's own, run alone, in fp32."""
    model = tiny_causal_lm(family, attention)
    rows = random_rows([9, 14, 5, 20, 11, 3, 17, 8])
    packs = pack(rows, 32)
    assert max(len(p) for p in packs) >= 3
    batch = collate_packed(packs, pad_id=0, one_row=one_row)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        leaky = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        spans = []  # where each row sits: (batch row, start, end)
        for i, in_row in enumerate([[row for p in packs for row in p]] if one_row else packs):
            ends = torch.tensor([len(ids) for ids, _ in in_row]).cumsum(0).tolist()
            spans += [(i, end - len(ids), end) for (ids, _), end in zip(in_row, ends)]
        packed = iter(spans)
        for ids, labels in rows:
            i, a, b = next(packed)
            assert batch["input_ids"][i, a:b].tolist() == ids
            alone = model(input_ids=torch.tensor([ids])).logits[0]
            torch.testing.assert_close(logits[i, a:b], alone, rtol=1e-5, atol=1e-5)
            mine = summed_loss(logits[i, a:b], batch["labels"][i, a:b])
            assert mine.item() == pytest.approx(summed_loss(alone, torch.tensor(labels)).item(), rel=1e-5)
    # with a KV cache (the config's ``use_cache``) transformers ignores the restarts: why the module turns it off
    assert not torch.allclose(leaky, logits, rtol=1e-5, atol=1e-5)


def test_packing_refuses_an_attention_that_would_let_rows_see_each_other():
    model = tiny_causal_lm("llama", "sdpa")
    assert packed_layout(model) is False
    model.config._attn_implementation = "flash_attention_2"
    assert packed_layout(model) is True  # flash-attention reads the restarts in a batch of one row only
    model.config._attn_implementation = "paged|sdpa"
    with pytest.raises(PackingError, match=r"'paged\|sdpa' \(config._attn_implementation\).*--data.init_args.packing false"):
        packed_layout(model)
    with pytest.raises(PackingError, match="needs a Hugging Face model"):
        packed_layout(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="set packing or group_by_length, not both"):
        JsonlInstructions(packing=True, group_by_length=True)


def grouped_epoch(lengths, rank: int, epoch: int, skip: int = 0, world: int = 2, batch: int = 3) -> list[int]:
    sampler = LengthGroupedSampler(lengths, batch, world, rank, seed=7)
    sampler.set_epoch(epoch)
    sampler.skip = skip
    return list(sampler)


def test_length_grouped_batches_are_similar_shuffled_the_same_on_every_rank_and_resume():
    """Every rank computes the same epoch plan and takes its own share of each global batch: at each step the
    ranks' rows come from one slice of the sorted lengths; the batches' order is shuffled (not longest first),
    and a sampler told to skip the batches done serves the rest of the epoch's batches exactly."""
    lengths = torch.randint(2, 400, (100,), generator=torch.Generator().manual_seed(0)).tolist()
    ranks = [grouped_epoch(lengths, rank, epoch=0) for rank in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) == 100 // 6 * 3 and not set(ranks[0]) & set(ranks[1])
    assert ranks == [grouped_epoch(lengths, rank, epoch=0) for rank in (0, 1)]  # the same plan every time
    spread = []
    for step in range(len(ranks[0]) // 3):
        rows = [lengths[i] for r in ranks for i in r[3 * step : 3 * step + 3]]
        spread.append(max(rows) - min(rows))
    assert max(spread) < 60  # a global batch is 6 neighbours of 96 sorted lengths (up to 400)
    firsts = [max(lengths[i] for i in ranks[0][3 * s : 3 * s + 3]) for s in range(len(ranks[0]) // 3)]
    assert firsts != sorted(firsts, reverse=True) and firsts != sorted(firsts)  # batches in shuffled order
    assert grouped_epoch(lengths, 0, epoch=1) != ranks[0]  # reshuffled per epoch
    for rank in (0, 1):
        assert grouped_epoch(lengths, rank, epoch=0, skip=2 * 3) == ranks[rank][6:]


def test_a_resumed_loader_starts_after_the_batches_done_with_any_sampler():
    lengths = list(range(1, 41))
    for sampler in (ResumingSampler(lengths, num_replicas=2, rank=1, seed=3), LengthGroupedSampler(lengths, 4, 2, 1, 3)):
        sampler.set_epoch(2)
        whole = [batch.tolist() for batch in ResumableLoader(lengths, batch_size=4, sampler=sampler, drop_last=True)]
        loader = ResumableLoader(lengths, batch_size=4, sampler=sampler, drop_last=True, batches_done=lambda: 0)
        loader.load_state_dict({"batches_done": 3})
        assert len(whole) == 5 and [batch.tolist() for batch in loader] == whole[3:]
        assert [batch.tolist() for batch in loader] == whole  # the next epoch whole again


def test_a_split_too_small_for_one_batch_a_rank_stops_before_the_first_step():
    data = JsonlInstructions(max_length=32, batch_size=2, packing=True)
    data.train, data.pad_id = pack(random_rows([9, 14, 5, 20, 11, 3, 17, 8]), 32), 0  # 3 packs
    model = tiny_causal_lm("llama", "sdpa")
    data.trainer = SimpleNamespace(world_size=2, global_rank=0, lightning_module=model)
    assert len(data.train_dataloader()) == 1
    data.trainer.world_size = 4
    with pytest.raises(ValueError, match=r"holds 3 packs of up to 32 tokens, fewer than one batch of batch_size 2 on each of 4 ranks: lower --data.init_args.batch_size"):
        data.train_dataloader()
    model.config._attn_implementation = "paged|sdpa"
    with pytest.raises(PackingError):  # refused when the loader is asked for, before any step
        data.train_dataloader()
