"""The `lightning-zero3` command (LightningCLI): typed strategy settings, the example YAMLs, --print_config.

``test_each_example_config_trains_a_few_steps`` runs the training commands that docs/configuration.md prints
(every ``examples/configs/gpt_*.yaml``), with fewer steps."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_zero3 import Zero3Config, Zero3Strategy
from lightning_zero3.cli import build_cli, main
from lightning_zero3.config.knobs import field_docs

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "examples" / "configs").glob("gpt_*.yaml"))  # whole configs; the others are overlays
SMALL = [  # a few steps of a small GPT on a small corpus
    "--trainer.max_steps", "3", "--trainer.log_every_n_steps", "1", "--trainer.val_check_interval", "3",
    "--trainer.limit_val_batches", "1", "--model.init_args.cfg.n_layer", "2", "--model.init_args.cfg.n_embd", "64",
    "--model.init_args.cfg.block_size", "32", "--data.init_args.block_size", "32",
    "--data.init_args.corpus_bytes", "100000",
]  # fmt: skip


def test_strategy_signature_and_config_fields_agree():
    """[Note: one list of knobs]: one keyword per Zero3Config field, same name, same default, documented."""
    params = inspect.signature(Zero3Strategy.__init__).parameters
    knobs = [name for name, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert knobs == Zero3Config.field_names()
    defaults = Zero3Config()
    for name in knobs:
        assert params[name].default == getattr(defaults, name), name
        assert params[name].annotation is not inspect.Parameter.empty, name
    docs = field_docs()
    assert set(docs) == set(knobs)
    for name in knobs:
        assert f"    {name}: {' '.join(docs[name].split())[:40]}" in Zero3Strategy.__init__.__doc__


@pytest.fixture(autouse=True)
def _command_line(monkeypatch):
    monkeypatch.chdir(ROOT)  # class paths such as examples.gpt.GPTModule resolve from here
    monkeypatch.setattr(sys, "argv", ["lightning-zero3"])  # pytest's own arguments are not the CLI's


def _cli(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as done:
        main(list(args))
    captured = capsys.readouterr()
    assert done.value.code == 0, captured.err[-3000:]
    return captured.out


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_print_config_round_trips(config, tmp_path, capsys):
    printed = _cli(capsys, "fit", "--config", str(config), "--print_config")
    (tmp_path / "printed.yaml").write_text(printed)
    again = _cli(capsys, "fit", "--config", str(tmp_path / "printed.yaml"), "--print_config")
    assert again == printed
    loaded = yaml.safe_load(printed)
    assert {c["class_path"] for c in loaded["trainer"]["callbacks"]} == {
        "lightning_zero3.callbacks.MemoryMonitor",
        "lightning_zero3.callbacks.CommMonitor",
    }


@pytest.mark.parametrize("config", sorted((ROOT / "examples" / "configs").glob("finetune_*.yaml")), ids=lambda p: p.name)
def test_the_finetune_configs_parse_and_round_trip(config, tmp_path, capsys):
    """The fine-tuning YAMLs parse (the GPU one is not run here: no GPU); the GPU one is bf16 on 8 devices
    with activation checkpointing and its offload switches; the multimodal one freezes the vision tower."""
    pytest.importorskip("transformers")
    printed = _cli(capsys, "fit", "--config", str(config), "--print_config")
    (tmp_path / "printed.yaml").write_text(printed)
    assert _cli(capsys, "fit", "--config", str(tmp_path / "printed.yaml"), "--print_config") == printed
    loaded = yaml.safe_load(printed)
    if config.name == "finetune_gpu.yaml":
        trainer, strategy = loaded["trainer"], loaded["trainer"]["strategy"]["init_args"]
        assert (trainer["accelerator"], trainer["devices"], trainer["precision"]) == ("gpu", 8, "bf16-mixed")
        assert loaded["model"]["init_args"]["activation_checkpointing"] is True
        assert "offload_optimizer" in strategy and "offload_params" in strategy
    if config.name == "finetune_llava.yaml":
        assert loaded["model"]["init_args"]["freeze"] == ["model.vision_tower"]
        assert loaded["trainer"]["strategy"]["init_args"]["offload_optimizer"] is None


def test_the_int8_overlay_turns_the_main_job_into_the_quality_run(capsys):
    """README "Across nodes": the main job's config plus ``int8_gathers.yaml`` is the 300-step int8 run."""
    configs = ROOT / "examples" / "configs"
    printed = _cli(capsys, "fit", "--config", str(configs / "gpt_zero3.yaml"), "--config",
                   str(configs / "int8_gathers.yaml"), "--print_config")  # fmt: skip
    trainer = yaml.safe_load(printed)["trainer"]
    assert trainer["max_steps"] == 300 and trainer["logger"]["init_args"]["name"] == "gpt-zero3-int8"
    assert trainer["strategy"]["init_args"]["quantize_gathers"] == "int8"
    assert len(trainer["callbacks"]) == 2  # the monitors stay on


def test_strategy_settings_are_documented_in_the_cli_help(capsys):
    out = _cli(capsys, "fit", "--trainer.strategy.help", "lightning_zero3.Zero3Strategy")
    for name in ("persistence_threshold", "offload_optimizer", "deepspeed_config"):
        assert f"--trainer.strategy.{name}" in out
    assert "Parameters with fewer elements than this are not sharded" in " ".join(out.split())


def test_a_bad_value_fails_while_parsing_with_the_field_named(capsys):
    config = str(ROOT / "examples" / "configs" / "gpt_zero3_offload.yaml")
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", config, "--trainer.strategy.init_args.offload_optimizer", "disk", "--print_config"])
    assert done.value.code != 0
    assert "offload_optimizer" in capsys.readouterr().err
    # range checks run when the CLI builds the strategy, still before any process starts
    with pytest.raises(ValueError, match="`persistence_threshold` must be >= 0, got -5"):
        build_cli(["--config", config, "--trainer.strategy.init_args.persistence_threshold", "-5"], run=False)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_each_example_config_trains_a_few_steps(config, tmp_path):
    cmd = [sys.executable, "-m", "lightning_zero3.cli", "fit", "--config", str(config), *SMALL]
    cmd += ["--trainer.logger.init_args.save_dir", str(tmp_path)]
    if "nvme" in config.name:
        cmd += ["--trainer.strategy.init_args.nvme_path", str(tmp_path / "nvme")]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    (run,) = [p.parent for p in tmp_path.rglob("events.out.tfevents.*")]
    scalars = EventAccumulator(str(run)).Reload().Tags()["scalars"]
    assert "train_loss" in scalars
    assert "zero3/memory/param_shards_bytes/max" in scalars
    assert "zero3/comm/all_gather/busbw_GBps/mean" in scalars
