"""Fine-tuning a pretrained Hugging Face model: the jobs of ``examples/configs/finetune_*.yaml`` through
``lightning-zero3 fit`` under zero3 and DDP, from one bf16 checkpoint with its own subword tokenizer, on a
jsonl file of instruction, chat and text rows (packed for the full fine-tune, in length-grouped batches for
LoRA); and an interrupted packed job resumed with ``--ckpt_path last`` (``tests/scripts/finetune_run.py``,
one spawned job for all)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from distributed import run_script

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from safetensors.torch import load_file  # noqa: E402

SCRIPT = Path(__file__).parents[1] / "scripts" / "finetune_run.py"
RUNS = ("full-zero3", "full-ddp", "lora-zero3", "lora-ddp", "adapter-zero3", "adapter-ddp")
# as tests/frontends/test_parity.py: clipping's global norm is summed in another order than DDP's, which moves
# weights by a few 1e-9 here (losses of the 4 steps agree bitwise)
WEIGHT_ATOL = 5e-5


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    out = tmp_path_factory.mktemp("finetune")
    run_script(SCRIPT, out)
    return out


@pytest.fixture(scope="module")
def ranks(out):
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_the_first_loss_is_the_pretrained_models_own(ranks):
    """The model zero3 reads from the bf16 checkpoint into fp32 shards is the pretrained model: its first
    training loss is what ``from_pretrained`` gives on that batch's rows, each run alone (LoRA's B starts at
    zero), with the loss summed over this rank's response tokens and divided by the count of all ranks'
    (times the world size). For the packed full fine-tune this is each packed row's loss equal to its
    unpacked loss, through the whole job, under zero3 and DDP."""
    for result in ranks:
        for run in RUNS:
            first, pretrained = result[run]["losses"][0], result[run]["pretrained_loss"]
            assert first == pytest.approx(pretrained, rel=1e-6, abs=0), run


def test_the_full_fine_tune_trains_on_packs_of_several_rows(ranks):
    for result in ranks:
        for run in ("full-zero3", "full-ddp"):
            packs = result[run]["items"]
            assert len(packs) == 9 and sum(packs) == 22 and max(packs) == 3, packs  # every row, whole, once
            first = result[run]["first_batch"]
            assert first["shape"][0] == 1 and first["shape"][1] <= 80, first  # one pack a batch
        assert result["lora-zero3"]["items"] == [1] * 22 and result["lora-zero3"]["first_batch"]["rows"] == 2


def test_zero3_losses_equal_ddps_from_pretrained(ranks):
    """DDP loads with transformers' ``from_pretrained`` (and peft's ``get_peft_model`` for new adapters, its
    loader for saved ones); zero3 runs the recipe (``lightning_zero3.from_pretrained``: built on the meta device,
    read straight into the shards)."""
    for result in ranks:
        for variant in ("full", "lora", "adapter"):
            zero3, ddp = result[f"{variant}-zero3"]["losses"], result[f"{variant}-ddp"]["losses"]
            assert len(zero3) == len(ddp) == 6
            assert zero3 == pytest.approx(ddp, rel=1e-6, abs=0), variant


def test_the_generator_after_the_load_is_ddps_after_from_pretrained_on_every_rank(ranks):
    """No random number is drawn for the tensors the checkpoint holds ([Note: draws wait for a load]): the
    next ``torch.rand`` equals DDP's after ``from_pretrained``, also after peft drew new adapters."""
    for result in ranks:
        for variant in ("full", "lora", "adapter"):
            assert result[f"{variant}-zero3"]["rand_after_load"] == result[f"{variant}-ddp"]["rand_after_load"], variant
    assert ranks[0]["full-zero3"]["rand_after_load"] != ranks[0]["lora-zero3"]["rand_after_load"]  # peft drew


def test_lora_trains_only_the_adapters_with_sharded_optimizer_state(ranks):
    lora = [result["lora-zero3"] for result in ranks]
    for result in lora:
        assert result["trainable_units"] == ["<persistent>"]  # every sharded unit is frozen: no gradient shard
    adapters = lora[0]["adapter_elements"]
    held = [result["state_elements"] for result in lora]  # Adam's two moments, this rank's slice only
    assert sum(held) == 2 * adapters and max(held) < 2 * adapters
    full = ranks[0]["full-zero3"]
    assert len(full["trainable_units"]) == 5  # the full fine-tune trains every unit


def test_peft_save_pretrained_writes_ddps_adapter_files(out):
    zero3, ddp = out / "lora-zero3" / "adapter", out / "lora-ddp" / "adapter"
    assert json.loads((zero3 / "adapter_config.json").read_text()) == json.loads((ddp / "adapter_config.json").read_text())
    mine, theirs = load_file(zero3 / "adapter_model.safetensors"), load_file(ddp / "adapter_model.safetensors")
    assert mine.keys() == theirs.keys() and mine
    for name in mine:
        torch.testing.assert_close(mine[name], theirs[name], rtol=0, atol=WEIGHT_ATOL)


def test_exports_reload_with_from_pretrained_to_the_trained_weights_bitwise(out):
    """The full fine-tune's export is the trained model, bitwise (and DDP's within the parity tolerance);
    the LoRA export is the base with the adapters merged, as peft's ``merge_and_unload`` gives it."""
    load = transformers.AutoModelForCausalLM.from_pretrained
    exported = {s: load(out / f"full-{s}" / "model", dtype=torch.float32).state_dict() for s in ("zero3", "ddp")}
    for strategy, weights in exported.items():
        trained = torch.load(out / f"full-{strategy}" / "trained.pt")
        assert weights.keys() == trained.keys()
        for name in weights:
            assert torch.equal(weights[name], trained[name]), (strategy, name)
    for name in exported["zero3"]:
        torch.testing.assert_close(exported["zero3"][name], exported["ddp"][name], rtol=0, atol=WEIGHT_ATOL)
    base = load(out / "pretrained", dtype=torch.float32)
    merged = peft.PeftModel.from_pretrained(base, out / "lora-zero3" / "adapter").merge_and_unload().state_dict()
    mine = load(out / "lora-zero3" / "model", dtype=torch.float32).state_dict()
    assert merged.keys() == mine.keys()
    for name in merged:
        assert torch.equal(merged[name], mine[name]), name
    start = load(out / "pretrained", dtype=torch.float32).state_dict()["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(mine["model.layers.0.self_attn.q_proj.weight"], start)  # the adapters were merged in


def test_an_interrupted_job_resumed_with_ckpt_path_last_gives_the_uninterrupted_losses(ranks):
    """Stopped after 3 of 6 steps (mid-epoch, warmup and cosine still under way), then the same command with
    ``--ckpt_path last``: the 6 losses equal the uninterrupted run's bitwise, so the weights, AdamW's
    moments, the LR schedule and the position in the shuffled packs all resumed (the 6th step is in the
    second epoch, reshuffled)."""
    for result in ranks:
        resume = result["resume"]
        assert resume["checkpoints"] == ["last.ckpt"] and resume["global_step"] == 6
        assert len(resume["interrupted"]) == 3
        assert resume["interrupted"] + resume["resumed"] == result["full-zero3"]["losses"]


def test_the_checkpoint_given_is_only_read(ranks):
    assert all(result["checkpoint_unchanged"] for result in ranks)
