"""Trained weights straight to Hugging Face: a directory ``from_pretrained`` loads, from a live run
(``save_full_weights``) and from a sharded checkpoint (``zero3-consolidate --format hf``)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from distributed import run_ranks

transformers = pytest.importorskip("transformers")

from lightning_zero3 import Zero3Config, Zero3Engine, save_full_weights  # noqa: E402
from lightning_zero3.checkpoint import save_sharded_checkpoint  # noqa: E402
from lightning_zero3.checkpoint.consolidate import main as consolidate  # noqa: E402
from lightning_zero3.checkpoint.verify import main as verify  # noqa: E402

CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True)  # fmt: skip
PROMPT = torch.arange(12).reshape(2, 6) % 64


class Wrapper(torch.nn.Module):
    """What a LightningModule around a Hugging Face model looks like: the model under ``self.model``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))

    def forward(self, ids):
        return self.model(input_ids=ids).logits


def _train_and_export(rank: int, world: int, out: str) -> dict:
    wrapper = Wrapper()
    engine = Zero3Engine(wrapper, Zero3Config(persistence_threshold=100))
    optimizer = engine.shard_optimizer(torch.optim.AdamW(wrapper.parameters(), lr=1e-2))
    for step in range(2):
        ids = (torch.arange(16).reshape(2, 8) * (rank + 2 + step)) % 64
        logits = wrapper(ids)
        torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 64), ids[:, 1:].reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        logits = wrapper(PROMPT)  # the trained model's own answer, on every rank
    save_full_weights(wrapper, Path(out) / "live", max_shard_size="40KB")  # a directory: several files
    save_sharded_checkpoint(Path(out) / "ckpt", engine, [optimizer], {})
    return {"logits": logits}


def test_a_trained_hugging_face_model_loads_with_from_pretrained(tmp_path, capsys):
    ranks = run_ranks(_train_and_export, 2, str(tmp_path))
    consolidate([str(tmp_path / "ckpt"), str(tmp_path / "consolidated")])  # the format comes from the checkpoint
    live = tmp_path / "live"
    index = json.loads((live / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in live.glob("*.safetensors"))
    assert len(files) > 1 and set(index["weight_map"].values()) == set(files)  # split above max_shard_size
    assert json.loads((live / "config.json").read_text())["num_hidden_layers"] == 3
    for directory in (live, tmp_path / "consolidated"):
        model = transformers.AutoModelForCausalLM.from_pretrained(directory)
        with torch.no_grad():
            logits = model(input_ids=PROMPT).logits
        torch.testing.assert_close(logits, ranks[0]["logits"], rtol=0, atol=1e-6)
    for directory in (live, tmp_path / "consolidated"):  # SHA256SUMS: every other file's SHA-256, as written
        sums = dict(reversed(line.split()) for line in (directory / "SHA256SUMS").read_text().splitlines())
        assert set(sums) == {p.name for p in directory.iterdir()} - {"SHA256SUMS"}
        assert all(hashlib.sha256((directory / name).read_bytes()).hexdigest() == sums[name] for name in sums)
        assert verify([str(directory)]) == 0
    shard = live / files[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size
    shard.write_bytes(bytes(data))
    assert verify([str(live)]) == 1
    assert f"BAD {shard}: found the sha256 checksum" in capsys.readouterr().out
