"""``load_pretrained``: a pretrained checkpoint read straight into zero3's shards (each rank its own byte
ranges), into a model zero3 sharded already, or into an ordinary one; and every bad input refused before
any weight changes, naming the tensors, on every rank."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from distributed import run_ranks

transformers = pytest.importorskip("transformers")

from lightning_zero3 import (  # noqa: E402
    CheckpointError,
    CheckpointMismatchError,
    PeerLoadError,
    Zero3Config,
    Zero3Engine,
    from_pretrained,
    load_pretrained,
)  # fmt: skip
from lightning_zero3.engine.layout import sources  # noqa: E402
from lightning_zero3.engine.layout.materialize import parameters_on_meta  # noqa: E402

CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True)  # fmt: skip
IDS = torch.arange(12).reshape(2, 6) % 64
SMALL_UNITS = Zero3Config(persistence_threshold=100, tune_collectives=False)


def _save(directory: Path, seed: int, dtype=torch.bfloat16, **changes) -> Path:
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**CONFIG, **changes})).to(dtype)
    model.save_pretrained(directory, max_shard_size="20KB")  # several files and an index
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrained")
    sharded = _save(root / "sharded", seed=0)
    assert (sharded / "model.safetensors.index.json").is_file()
    single = root / "single"
    transformers.AutoModelForCausalLM.from_pretrained(sharded).save_pretrained(single)  # one model.safetensors
    other = _save(root / "other", seed=1)
    reference = transformers.AutoModelForCausalLM.from_pretrained(sharded, dtype=torch.float32)
    state = {f"model.{k}": v.clone() for k, v in reference.state_dict().items()}
    torch.save({"state_dict": state, "epoch": 3}, root / "lightning.ckpt")  # a Lightning checkpoint: names under model.
    return {"root": root, "sharded": sharded, "single": single, "other": other}


def _meta_model(directory: Path, dtype=torch.float32) -> torch.nn.Module:
    config = transformers.AutoConfig.from_pretrained(directory)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _reference_logits(directory: Path, dtype=torch.float32) -> torch.Tensor:
    return _logits(transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype))


# -- loading, on 2 ranks ----------------------------------------------------------------------------


def _load_case(rank: int, world: int, paths: dict, nvme: str) -> dict:
    out: dict = {}
    for name, (source, config, dtype) in {
        "sharded": (paths["sharded"], SMALL_UNITS, torch.float32),
        "single": (paths["single"], SMALL_UNITS, torch.float32),
        "bf16": (paths["sharded"], SMALL_UNITS, torch.bfloat16),
        "cpu": (paths["sharded"], Zero3Config(persistence_threshold=100, offload_optimizer="cpu", offload_params="cpu"), torch.float32),
        "nvme": (paths["sharded"], Zero3Config(persistence_threshold=100, offload_optimizer="nvme",
                                               offload_params="nvme", nvme_path=nvme), torch.float32),
    }.items():  # fmt: skip
        model = load_pretrained(_meta_model(paths["sharded"], dtype), source)
        engine = Zero3Engine(model, config, device=torch.device("cpu"))
        out[name] = _logits(model)
        out[f"{name}-gathered"] = engine.memory_report()["gathered_params"]
        if name == "sharded":
            load_pretrained(model, paths["other"])  # into the sharded model, in place
            out["other"] = _logits(model)
            load_pretrained(model, paths["root"] / "lightning.ckpt", prefix="model.")
            out["lightning"] = _logits(model)
        engine.close() if name in ("cpu", "nvme") else None
    # from_pretrained in __init__ (every rank holds the whole model first), then sharded: as before
    whole = transformers.AutoModelForCausalLM.from_pretrained(paths["sharded"], dtype=torch.float32)
    Zero3Engine(whole, SMALL_UNITS)
    out["init"] = _logits(whole)
    # a failure on one rank fails both, and neither model keeps anything from the checkpoint
    model = _meta_model(paths["sharded"])
    broken = paths["sharded"] if rank == 0 else paths["root"] / "missing"
    try:
        load_pretrained(model, broken)
    except (PeerLoadError, CheckpointError) as error:
        out["error"] = (type(error).__name__, str(error))
    out["pending_after_error"] = sources.pending_on(model)
    return out


@pytest.fixture(scope="module")
def loaded(checkpoints, tmp_path_factory):
    return run_ranks(_load_case, 2, checkpoints, str(tmp_path_factory.mktemp("nvme")))


def test_a_meta_model_loads_each_ranks_shards_and_computes_as_from_pretrained(checkpoints, loaded):
    """bf16 files into fp32 masters (and into bf16 ones), one file or an index of several, with the
    parameters on the device, in host memory or on NVMe: the logits are ``from_pretrained``'s, bitwise."""
    fp32, bf16 = _reference_logits(checkpoints["sharded"]), _reference_logits(checkpoints["sharded"], torch.bfloat16)
    for result in loaded:
        for name in ("sharded", "single", "cpu", "nvme"):
            assert torch.equal(result[name], fp32), name
            assert result[f"{name}-gathered"] == 0, name  # nothing left gathered after the load
        assert torch.equal(result["bf16"], bf16)
        assert torch.equal(result["init"], fp32)


def test_a_sharded_model_loads_in_place_and_a_lightning_checkpoint_with_a_prefix(checkpoints, loaded):
    other = _reference_logits(checkpoints["other"])
    for result in loaded:
        assert torch.equal(result["other"], other)
        assert torch.equal(result["lightning"], _reference_logits(checkpoints["sharded"]))


def test_a_failure_on_one_rank_fails_every_rank_before_anything_is_kept(loaded):
    assert loaded[1]["error"][0] == "CheckpointError" and "does not exist" in loaded[1]["error"][1]
    assert loaded[0]["error"][0] == "PeerLoadError"
    assert "failed on rank 1" in loaded[0]["error"][1] and "does not exist" in loaded[0]["error"][1]
    assert not loaded[0]["pending_after_error"] and not loaded[1]["pending_after_error"]


# -- one process: ordinary models, frozen/partial loads, the bad inputs ----------------------------------


def test_an_ordinary_model_loads_whole_and_strict_false_keeps_what_is_missing(checkpoints, tmp_path):
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))  # as under DDP
    assert load_pretrained(model, checkpoints["single"]) is model
    assert torch.equal(_logits(model), _reference_logits(checkpoints["sharded"]))
    # a state dict without one layer: with strict=False that layer keeps its values
    partial = {k: v for k, v in model.state_dict().items() if ".layers.2." not in k}
    torch.save(partial, tmp_path / "partial.pt")
    fresh = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    kept = fresh.model.layers[2].mlp.up_proj.weight.detach().clone()
    load_pretrained(fresh, tmp_path / "partial.pt", strict=False)
    assert torch.equal(fresh.model.layers[2].mlp.up_proj.weight, kept)
    assert torch.equal(fresh.model.layers[0].mlp.up_proj.weight, model.model.layers[0].mlp.up_proj.weight)
    renamed = {k.replace("mlp.", "feed_forward."): v for k, v in model.state_dict().items()}
    torch.save(renamed, tmp_path / "renamed.pt")
    back = load_pretrained(transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)), tmp_path / "renamed.pt",
                           key_map=lambda name: name.replace("feed_forward.", "mlp."))  # fmt: skip
    assert torch.equal(_logits(back), _logits(model))


@pytest.mark.parametrize("route", ["from_pretrained", "from_config + load_pretrained"])
def test_a_load_where_the_model_is_built_draws_only_what_from_pretrained_draws(route, checkpoints, tmp_path):
    """[Note: draws wait for a load]: loaded inside the block that builds it (as ``configure_model``), a
    model gets ``from_pretrained``'s weights and leaves the generator where ``from_pretrained`` does: nothing
    drawn for a complete checkpoint; for one without ``lm_head``, ``from_pretrained``'s init of that alone."""
    from safetensors.torch import save_file

    untied = _save(tmp_path / "untied", seed=2, tie_word_embeddings=False)
    headless = tmp_path / "headless"
    headless.mkdir()
    shutil.copy(untied / "config.json", headless)
    weights = transformers.AutoModelForCausalLM.from_pretrained(untied).state_dict()
    save_file({k: v.contiguous() for k, v in weights.items() if not k.startswith("lm_head")}, headless / "model.safetensors")
    for path in (untied, headless):
        torch.manual_seed(0)
        reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        after_reference = torch.rand(4)
        torch.manual_seed(0)
        with parameters_on_meta():  # what configure_model runs in under zero3
            if route == "from_pretrained":
                model = from_pretrained(transformers.AutoModelForCausalLM, path, dtype=torch.float32)
            else:
                model = load_pretrained(_meta_free_model(path), path, strict=False)
        assert torch.equal(torch.rand(4), after_reference), path.name
        Zero3Engine(model, SMALL_UNITS, device=torch.device("cpu"))
        assert torch.equal(_logits(model), _logits(reference)), path.name
    outside = from_pretrained(transformers.AutoModelForCausalLM, untied, dtype=torch.float32)  # not under zero3
    assert type(outside) is type(reference) and torch.equal(_logits(outside), _reference_logits(untied))


def _meta_free_model(directory: Path) -> torch.nn.Module:
    """``from_config`` as a recipe calls it (inside ``parameters_on_meta()`` its parameters go to meta)."""
    return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(directory),
                                                         dtype=torch.float32)  # fmt: skip


def _broken(kind: str, checkpoints: dict, tmp: Path) -> tuple[Path, dict]:
    """A bad checkpoint of ``kind``, and what ``load_pretrained`` is called with."""
    copy = tmp / kind
    shutil.copytree(checkpoints["sharded"], copy)
    index = json.loads((copy / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    if kind == "no directory":
        return tmp / "nowhere", {}
    if kind == "no weights":
        for file in copy.glob("*.safetensors*"):
            file.unlink()
        return copy, {}
    if kind == "truncated":
        data = (copy / first).read_bytes()
        (copy / first).write_bytes(data[: len(data) - 100])
        return copy, {}
    if kind == "corrupt header":
        data = bytearray((copy / first).read_bytes())
        data[8:20] = b"not a header"
        (copy / first).write_bytes(bytes(data))
        return copy, {}
    if kind == "missing shard":
        (copy / first).unlink()
        return copy, {}
    if kind == "missing index entry":
        name = next(iter(index["weight_map"]))
        index["weight_map"][name.replace("weight", "scale")] = index["weight_map"][name]
        (copy / "model.safetensors.index.json").write_text(json.dumps(index))
        return copy, {}
    if kind == "missing keys":
        del index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
        (copy / "model.safetensors.index.json").write_text(json.dumps(index))
        return copy, {}
    if kind == "unexpected keys":
        state = transformers.AutoModelForCausalLM.from_pretrained(checkpoints["sharded"]).state_dict()
        state["model.layers.0.extra.weight"] = torch.zeros(3)
        torch.save(state, tmp / "extra.pt")
        return tmp / "extra.pt", {}
    if kind == "shapes":
        return _save(tmp / "wider", seed=0, hidden_size=48, num_attention_heads=4), {}
    if kind == "prefix":  # (``model.`` itself would load: it is the Llama's base_model_prefix, which transformers strips)
        state = torch.load(checkpoints["root"] / "lightning.ckpt", weights_only=True)["state_dict"]
        torch.save({"state_dict": {f"net.{k[len('model.'):]}": v for k, v in state.items()}}, tmp / "net.ckpt")
        return tmp / "net.ckpt", {}
    if kind == "corrupt torch file":
        torch.save({"w": torch.zeros(10)}, tmp / "model.pt")
        (tmp / "model.pt").write_bytes((tmp / "model.pt").read_bytes()[:200])
        return tmp / "model.pt", {}
    raise AssertionError(kind)


BAD_INPUTS = {
    "no directory": (CheckpointError, r"nowhere does not exist"),
    "no weights": (CheckpointError, r"holds no weights that zero3 reads"),
    "truncated": (CheckpointError, r"is truncated: '[^']+' needs bytes up to \d+, the file has \d+"),
    "corrupt header": (CheckpointError, r"(header of .* is corrupt|cannot hold the header)"),
    "missing shard": (CheckpointError, r"lists \['model-0000\d-of-0000\d\.safetensors'\].*download is incomplete"),
    "missing index entry": (CheckpointError, r"says \['model\.[a-z_.0-9]+scale'\] are in .* which does not hold them"),
    "missing keys": (CheckpointMismatchError, r"1 missing from the checkpoint: \['model\.layers\.1\.mlp\.up_proj\.weight'\]"),
    "unexpected keys": (CheckpointMismatchError, r"1 in the checkpoint but not in the model: \['model\.layers\.0\.extra\.weight'\]"),
    "shapes": (CheckpointMismatchError, r"shapes that differ: \['model\.embed_tokens\.weight: checkpoint \[64, 48\], model \[64, 32\]'"),
    "prefix": (CheckpointMismatchError, r"names start with 'net\.', which the model's do not: pass `prefix='net\.'`"),
    "corrupt torch file": (CheckpointError, r"cannot read .*model\.pt as a torch state dict"),
}


@pytest.mark.parametrize("kind", list(BAD_INPUTS))
def test_bad_input_is_refused_before_any_weight_changes(kind, checkpoints, tmp_path):
    path, kwargs = _broken(kind, checkpoints, tmp_path)
    error, message = BAD_INPUTS[kind]
    meta = _meta_model(checkpoints["sharded"])  # configure_model under zero3
    with pytest.raises(error, match=message):
        load_pretrained(meta, path, **kwargs)
    assert not sources.pending_on(meta)
    ordinary = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))  # DDP, one device
    before = {k: v.clone() for k, v in ordinary.state_dict().items()}
    sharded = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    engine = Zero3Engine(sharded, SMALL_UNITS)  # a model zero3 sharded already
    sharded_before = engine.full_state_dict()
    for model in (ordinary, sharded):
        with pytest.raises(error, match=message):
            load_pretrained(model, path, **kwargs)
    after = ordinary.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    sharded_after = engine.full_state_dict()
    assert all(torch.equal(sharded_before[k], sharded_after[k]) for k in sharded_before)


def test_a_model_built_from_a_config_with_remote_code_loads(tmp_path, monkeypatch):
    """``trust_remote_code``: a model class that ships beside its checkpoint, built from its config."""
    from safetensors.torch import save_file

    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "configuration_tiny.py").write_text(
        "from transformers import PretrainedConfig\n"
        "class TinyConfig(PretrainedConfig):\n"
        "    model_type = 'tiny-remote'\n"
        "    def __init__(self, width=8, **kwargs):\n"
        "        self.width = width\n"
        "        super().__init__(**kwargs)\n"
    )
    (checkpoint / "modeling_tiny.py").write_text(
        "import torch\n"
        "from transformers import PreTrainedModel\n"
        "from .configuration_tiny import TinyConfig\n"
        "class TinyModel(PreTrainedModel):\n"
        "    config_class = TinyConfig\n"
        "    def __init__(self, config):\n"
        "        super().__init__(config)\n"
        "        self.inner = torch.nn.Linear(config.width, config.width)\n"
        "        self.register_buffer('scale', torch.arange(config.width, dtype=torch.float32), persistent=False)\n"
        "        self.post_init()\n"
        "    def forward(self, x):\n"
        "        return self.inner(x) * self.scale\n"
    )
    auto_map = {"AutoConfig": "configuration_tiny.TinyConfig", "AutoModel": "modeling_tiny.TinyModel"}
    (checkpoint / "config.json").write_text(json.dumps({"model_type": "tiny-remote", "width": 8, "auto_map": auto_map}))
    config = transformers.AutoConfig.from_pretrained(checkpoint, trust_remote_code=True)
    torch.manual_seed(0)
    original = transformers.AutoModel.from_config(config, trust_remote_code=True)
    save_file(original.state_dict(), str(checkpoint / "model.safetensors"))
    with parameters_on_meta():  # what configure_model runs in under zero3
        model = transformers.AutoModel.from_config(config, trust_remote_code=True)
    load_pretrained(model, checkpoint)
    Zero3Engine(model, Zero3Config(persistence_threshold=10, tune_collectives=False), device=torch.device("cpu"))
    x = torch.ones(2, 8)
    with torch.no_grad():
        assert torch.equal(model(x), original(x))  # the buffer too: computed on every rank, not in the file
