"""Hub checkpoints whose names or layout differ from the model's (LLaVA / LLaVA-Next renames, Mixtral and
Qwen2-MoE per-expert tensors fused into ``experts.gate_up_proj``): ``load_pretrained`` applies transformers'
own rules, each rank still reading only its own byte ranges, and trains with DDP's losses; a rule it cannot
read by range, or a missing expert, fails before any weight changes, naming the tensor. The dense families
(Mistral, Qwen2, Gemma 3 text, and Gemma 3's image-text checkpoints with LLaVA's prefix renames) and peft
LoRA on Mixtral's attention and fused experts run in the same spawned job."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from distributed import run_ranks
from test_engine import side_by_side
from torch import nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.conversion_mapping")

from lightning_zero3 import CheckpointMismatchError, Zero3Config, Zero3Engine, load_pretrained, save_full_weights  # noqa: E402
from lightning_zero3.engine.layout.materialize import parameters_on_meta  # noqa: E402
from lightning_zero3.pretrained import tensor_files  # noqa: E402

T = transformers
IDS = (torch.arange(24).reshape(2, 12) * 7) % 60
SMALL_UNITS = Zero3Config(persistence_threshold=100, tune_collectives=False)
STEPS = 3


def tiny_model(kind: str) -> nn.Module:
    """A tiny model of the family, as ``save_pretrained`` would write it for a Hub checkpoint."""
    if kind == "mixtral":
        return T.MixtralForCausalLM(T.MixtralConfig(
            vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32))  # fmt: skip
    if kind == "qwen2_moe":
        return T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(
            vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_experts=4,
            shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            num_experts_per_tok=2, max_position_embeddings=32))  # fmt: skip
    if kind in ("mistral", "qwen2"):
        cls, config = (T.MistralForCausalLM, T.MistralConfig) if kind == "mistral" else (T.Qwen2ForCausalLM, T.Qwen2Config)
        return cls(config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=32))  # fmt: skip
    gemma = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=8, max_position_embeddings=128, sliding_window=8)  # fmt: skip
    if kind == "gemma3":
        return T.Gemma3ForCausalLM(T.Gemma3TextConfig(vocab_size=64, **gemma))
    if kind == "gemma3_vlm":  # the Hub's Gemma 3 checkpoints: ``language_model.model.*``, renamed as LLaVA's
        siglip = T.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      image_size=32, patch_size=8)  # fmt: skip
        return T.Gemma3ForConditionalGeneration(T.Gemma3Config(
            text_config=T.Gemma3TextConfig(vocab_size=80, **gemma), vision_config=siglip, mm_tokens_per_image=4,
            boi_token_index=77, eoi_token_index=78, image_token_index=79))  # fmt: skip
    vision = T.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                image_size=32, patch_size=8, projection_dim=32)  # fmt: skip
    text = T.LlamaConfig(vocab_size=80, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    if kind == "llava":
        return T.LlavaForConditionalGeneration(T.LlavaConfig(vision_config=vision, text_config=text, image_token_index=79))
    if kind == "llava_next":
        return T.LlavaNextForConditionalGeneration(T.LlavaNextConfig(
            vision_config=vision, text_config=text, image_token_index=79, image_grid_pinpoints=[[32, 32], [32, 64]]))  # fmt: skip
    raise ValueError(kind)


FAMILIES = ("mixtral", "qwen2_moe", "llava", "llava_next", "mistral", "qwen2", "gemma3", "gemma3_vlm")
MULTIMODAL = ("llava", "llava_next", "gemma3_vlm")


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hub")
    out = {}
    for kind in FAMILIES:
        torch.manual_seed(0)
        tiny_model(kind).to(torch.bfloat16).save_pretrained(root / kind, max_shard_size="40KB")
        (root / kind / "tokenizer_config.json").write_text('{"model_max_length": 32, "padding_side": "right"}\n')
        out[kind] = root / kind
    return out


def _loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    ids = (IDS + 3 * rank + 5 * step) % 60
    return model(input_ids=ids, labels=ids).loss


def _families_case(rank: int, world: int, paths: dict, exports: str) -> dict:
    out = {}
    for kind, path in paths.items():
        config = T.AutoConfig.from_pretrained(path)
        reference = T.AutoModelForImageTextToText if kind in MULTIMODAL else T.AutoModelForCausalLM
        whole = reference.from_pretrained(path, dtype=torch.float32)
        with torch.device("meta"):
            model = reference.from_config(config, dtype=torch.float32)
        read = []
        original = tensor_files.FileTensor.read

        def counting(self, start, out_, _read=read, _original=original):
            _read.append(out_.numel() * self.dtype.itemsize)
            return _original(self, start, out_)

        tensor_files.FileTensor.read = counting
        try:
            load_pretrained(model, path)
            engine = Zero3Engine(model, SMALL_UNITS, device=torch.device("cpu"))
        finally:
            tensor_files.FileTensor.read = original
        full = engine.full_state_dict()
        expected = whole.state_dict()
        out[f"{kind}-differ"] = [k for k in expected if not torch.equal(full[k], expected[k])]
        out[f"{kind}-read"] = sum(read)
        out[f"{kind}-total"] = sum(v.shape.numel() * 2 for v in _file_tensors(path).values())
        ddp = nn.parallel.DistributedDataParallel(whole, find_unused_parameters=True)
        optimizers = [torch.optim.AdamW(ddp.parameters(), lr=1e-3),
                      engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))]  # fmt: skip
        out[f"{kind}-losses"] = _train_side_by_side((ddp, model), optimizers, rank)
        save_full_weights(model, Path(exports) / kind, fmt="hf")  # the checkpoint's own layout back
        if rank == 0:
            whole.save_pretrained(Path(exports) / f"{kind}-save_pretrained")
        out[f"{kind}-trained"] = {k: v.clone() for k, v in engine.full_state_dict().items()}
        engine.close()
    if "mixtral" in paths:  # the same job: LoRA on the sliced Mixtral
        out["lora-mixtral"] = _lora_case(rank, paths["mixtral"])
    return out



def _train_side_by_side(nets, optimizers, rank: int) -> list[list[float]]:
    """``STEPS`` steps of each net (DDP's, then zero3's) on the same batches: the losses per step, in that order."""
    return side_by_side(nets, optimizers, STEPS, lambda net, step: _loss(net, rank, step))


def lora_config():
    """peft's LoRA on the attention and on the fused experts (``target_parameters``: peft's ``ParamWrapper``
    adds the adapters' product to ``experts.gate_up_proj`` / ``down_proj`` in the forward)."""
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])  # fmt: skip


def _lora_case(rank: int, path: Path) -> dict:
    """New LoRA adapters on a sliced Mixtral under zero3. Built as ``configure_model`` builds them (inside
    ``parameters_on_meta()``, the base read by ``load_pretrained``), they hold the numbers peft draws after
    ``from_pretrained`` with the same seed (the base's construction draws nothing, [Note: draws wait for a
    load]), the generator is where DDP's is after them, and they train with DDP's losses. Built under a plain ``torch.device("meta")``
    (nothing recorded), each half gets peft's rule as its unit is built, though the two halves of an
    adapter fall in different units (``SMALL_UNITS``): ``lora_B`` zero, ``lora_A`` drawn."""
    from peft import get_peft_model

    config = T.AutoConfig.from_pretrained(path)
    torch.manual_seed(1)
    whole = get_peft_model(T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), lora_config())
    rand_ddp = torch.rand(4)
    torch.manual_seed(1)
    with parameters_on_meta():
        model = get_peft_model(load_pretrained(T.AutoModelForCausalLM.from_config(config, dtype=torch.float32), path),
                               lora_config())  # fmt: skip
    rand_zero3 = torch.rand(4)
    engine = Zero3Engine(model, SMALL_UNITS, device=torch.device("cpu"))
    full = engine.full_state_dict()
    adapters = {k: v.clone() for k, v in whole.state_dict().items() if "lora_" in k}
    missing = [k for k in adapters if k not in full or not torch.equal(full[k], adapters[k])]
    ddp = nn.parallel.DistributedDataParallel(whole, find_unused_parameters=True)
    adapted = [[p for p in net.parameters() if p.requires_grad] for net in (ddp, model)]
    optimizers = [torch.optim.AdamW(adapted[0], lr=1e-2),
                  engine.shard_optimizer(torch.optim.AdamW(adapted[1], lr=1e-2))]  # fmt: skip
    losses = _train_side_by_side((ddp, model), optimizers, rank)
    full = engine.full_state_dict()
    moved = [k for k in adapters if not torch.equal(full[k], adapters[k])]
    engine.close()
    with torch.device("meta"):
        plain = T.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain = get_peft_model(load_pretrained(plain, path), lora_config())
    plain_engine = Zero3Engine(plain, SMALL_UNITS, device=torch.device("cpu"))
    plain_adapters = {k: v for k, v in plain_engine.full_state_dict().items() if "lora_" in k}
    plain_engine.close()
    return {"losses": losses, "adapters": sorted(adapters), "missing": sorted(missing), "moved": moved,
            "rand": (rand_zero3, rand_ddp),
            "plain": {k: (v.abs().sum().item(), v.shape == adapters[k].shape) for k, v in plain_adapters.items()}}  # fmt: skip


def _file_tensors(path: Path) -> dict:
    checkpoint = tensor_files.open_checkpoint(path)
    try:
        return {name: source for name, source in checkpoint.tensors.items()}
    finally:
        checkpoint.close()


@pytest.fixture(scope="module")
def trained(hub, tmp_path_factory):
    exports = tmp_path_factory.mktemp("exports")
    return {"ranks": run_ranks(_families_case, 2, hub, str(exports)), "exports": exports}


@pytest.mark.parametrize("kind", FAMILIES)
def test_a_hub_checkpoint_loads_sliced_and_trains_with_ddps_losses(kind, trained):
    trained = trained["ranks"]
    for rank, result in enumerate(trained):
        assert result[f"{kind}-differ"] == [], (rank, result[f"{kind}-differ"][:5])
        for ddp, zero3 in result[f"{kind}-losses"]:
            assert zero3 == pytest.approx(ddp, rel=1e-6)
        # each rank read its shards (plus the small persistent tensors every rank reads whole), never all
        assert result[f"{kind}-read"] < result[f"{kind}-total"]
    print(kind, [r[f"{kind}-losses"] for r in trained], [(r[f"{kind}-read"], r[f"{kind}-total"]) for r in trained])


def test_new_lora_adapters_on_the_sliced_mixtrals_attention_and_fused_experts_train_with_ddps_losses(trained):
    pytest.importorskip("peft")
    for rank, result in enumerate(trained["ranks"]):
        lora = result["lora-mixtral"]
        assert lora["missing"] == [], lora["missing"][:5]
        assert any("experts" in k for k in lora["adapters"]) and any("q_proj" in k for k in lora["adapters"])
        assert set(lora["moved"]) == set(lora["adapters"])  # every adapter trained
        assert torch.equal(*lora["rand"]), rank  # the generator after the build is DDP's after from_pretrained + peft
        for ddp, zero3 in lora["losses"]:
            assert zero3 == pytest.approx(ddp, rel=1e-6)
        assert set(lora["plain"]) == set(lora["adapters"]) and all(same for _, same in lora["plain"].values())
        assert all((total == 0) == ("lora_B" in k) for k, (total, _) in lora["plain"].items()), lora["plain"]
    print("lora-mixtral", [r["lora-mixtral"]["losses"] for r in trained["ranks"]])


def _header(directory: Path) -> dict:
    from safetensors import safe_open

    shapes = {}
    for file in directory.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            shapes.update({name: f.get_slice(name).get_shape() for name in f.keys()})
    return shapes


@pytest.mark.parametrize("kind", FAMILIES)
def test_the_export_is_the_checkpoints_own_layout_and_reloads_bitwise(kind, trained, hub):
    """``save_full_weights(..., fmt="hf")`` writes what ``save_pretrained`` writes (names and shapes: per-expert
    ``w1``/``w2``/``w3``, ``language_model.model.*``); ``from_pretrained`` reloads it bitwise; the source's
    config and tokenizer files are copied verbatim."""
    exported = trained["exports"] / kind
    assert _header(exported) == _header(trained["exports"] / f"{kind}-save_pretrained")
    for name in ("config.json", "tokenizer_config.json"):
        assert (exported / name).read_bytes() == (hub[kind] / name).read_bytes(), name
    auto = T.AutoModelForImageTextToText if kind in MULTIMODAL else T.AutoModelForCausalLM
    reloaded = auto.from_pretrained(exported, dtype=torch.float32).state_dict()
    expected = trained["ranks"][0][f"{kind}-trained"]
    assert sorted(reloaded) == sorted(expected)
    assert all(torch.equal(reloaded[k], expected[k]) for k in expected)


def test_a_missing_expert_and_an_unsliceable_rule_fail_before_any_weight_changes(hub, tmp_path, monkeypatch):
    import json

    from safetensors.torch import load_file, save_file

    source = hub["mixtral"]
    state = {}
    for file in sorted(source.glob("*.safetensors")):
        state.update(load_file(file))
    del state["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    state["model.layers.1.block_sparse_moe.experts.7.w3.weight"] = state["model.layers.1.block_sparse_moe.experts.0.w3.weight"].clone()
    broken = tmp_path / "broken"
    broken.mkdir()
    save_file(state, broken / "model.safetensors", metadata={"format": "pt"})
    (broken / "config.json").write_text((source / "config.json").read_text())
    torch.manual_seed(3)
    model = tiny_model("mixtral")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointMismatchError, match=r"experts\.gate_up_proj.*indices \[0, 1, 3, 7\].*missing \[2"):
        load_pretrained(model, broken)
    from transformers.core_model_loading import Transpose, WeightConverter, WeightRenaming

    rules = [WeightRenaming(".block_sparse_moe.", ".mlp."),
             WeightConverter(".experts.*.w2.weight", ".experts.down_proj", operations=[Transpose(1, 2)])]  # fmt: skip
    import transformers.conversion_mapping as conversion_mapping

    monkeypatch.setattr(conversion_mapping, "get_model_conversion_mapping", lambda model: rules)
    with pytest.raises(CheckpointMismatchError, match=r"down_proj.*Transpose.*cannot read by range"):
        load_pretrained(model, source)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert json.loads((source / "config.json").read_text())["model_type"] == "mixtral"


def test_a_lora_init_that_reads_the_base_weights_is_refused_naming_the_way_out():
    """PiSSA, OLoRA and the other rules computed from the base weights cannot run while a meta-built model
    is sharded (the base is not there): the error names the setting and the saved-adapter way."""
    from peft import LoraConfig, get_peft_model

    from lightning_zero3.engine.layout.initialisers import library_initialisers

    with torch.device("meta"):
        model = get_peft_model(tiny_model("mistral"), LoraConfig(r=2, target_modules=["q_proj"]))
    model.peft_config["default"].init_lora_weights = "olora"
    with pytest.raises(ValueError, match=r"init_lora_weights='olora'.*load_pretrained"):
        library_initialisers(model)  # every rank's Materializer asks for them before any unit is built
