"""litgpt's own pretraining and fine-tuning code on ``Fabric(strategy="zero3")`` (``examples/litgpt_zero3.py``,
run by ``tests/scripts/litgpt_run.py``): a tiny litgpt config, random weights written first, no download.
These are the jobs that README.md and docs/fabric-litgpt.md print (``python examples/litgpt_zero3.py JOB --out
DIR``), called through the script's ``run`` with fewer steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from distributed import run_script

pytest.importorskip("litgpt")

SCRIPT = Path(__file__).parents[1] / "scripts" / "litgpt_run.py"


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    out = tmp_path_factory.mktemp("litgpt")
    run_script(SCRIPT, out)
    return out


def _losses(out: Path, run: str, rank: int) -> list[float]:
    rows = json.loads((out / run / f"losses-{rank}.json").read_text())
    return [row["loss"] for row in rows if "loss" in row]


def test_litgpt_pretraining_under_zero3_gives_fsdp2s_losses(out):
    """litgpt's ``pretrain.main`` (``torch.compile``, ``no_backward_sync``, clipping, ``fabric.save``) from the
    same initial checkpoint: zero3 against FSDP2 sharding each litgpt ``Block`` (litgpt's own FSDP1 needs a
    GPU: Fabric refuses it on CPU)."""
    for rank in range(2):
        zero3, fsdp2 = _losses(out, "pretrain-zero3", rank), _losses(out, "pretrain-fsdp2", rank)
        assert len(zero3) == len(fsdp2) == 20
        assert zero3 == pytest.approx(fsdp2, rel=1e-5, abs=0)
    # litgpt puts its DataLoader itself into the state it saves (pickled, as under any strategy)
    final = torch.load(out / "pretrain-zero3" / "final" / "lit_model.pth", weights_only=False)
    assert {"model", "optimizer", "iter_num"} <= final.keys()  # a full checkpoint, as litgpt's FSDP run writes
    reference = torch.load(out / "pretrain-fsdp2" / "final" / "lit_model.pth", weights_only=False)["model"]
    for name, value in final["model"].items():
        torch.testing.assert_close(value, reference[name], rtol=0, atol=5e-5)


def test_litgpt_full_finetuning_under_zero3_gives_ddps_losses(out):
    for rank in range(2):
        zero3, ddp = _losses(out, "finetune_full-zero3", rank), _losses(out, "finetune_full-ddp", rank)
        assert len(zero3) == len(ddp) == 20  # 10 steps of 2 micro-batches, logged per micro-batch
        assert zero3 == pytest.approx(ddp, rel=1e-5, abs=0)


def test_litgpt_lora_finetuning_starts_from_the_base_model_and_merges(out):
    """LoRA's B starts at zero, so the first loss is the base model's (the full fine-tune's first); litgpt saves
    the adapters and merges them into ``lit_model.pth`` itself."""
    for rank in range(2):
        lora, full = _losses(out, "finetune_lora-zero3", rank), _losses(out, "finetune_full-zero3", rank)
        assert len(lora) == 20 and lora[0] == pytest.approx(full[0], rel=1e-6, abs=0)
        assert lora[-1] != lora[0]
    final = out / "finetune_lora-zero3" / "final"
    adapters = torch.load(final / "lit_model.pth.lora", weights_only=True)["model"]
    assert adapters and all("lora_" in name for name in adapters)
    merged = torch.load(final / "lit_model.pth", weights_only=True)
    base = torch.load(out / "finetune_lora-zero3" / "checkpoint" / "lit_model.pth", weights_only=True)
    assert merged.keys() == base.keys()
    assert not torch.equal(merged["transformer.h.0.attn.qkv.weight"], base["transformer.h.0.attn.qkv.weight"])
    assert torch.equal(merged["transformer.h.0.mlp.fc_1.weight"], base["transformer.h.0.mlp.fc_1.weight"])  # frozen, no LoRA
