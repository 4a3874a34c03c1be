"""Zero3Strategy inside Lightning: registration, flags, the fit/validate/test/predict flows, failures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.strategies import StrategyRegistry

import lightning_zero3
from lightning_zero3 import UnsupportedPrecisionError, Zero3Config, Zero3ConfigError, Zero3Precision, Zero3Strategy

SCRIPT = Path(__file__).parent / "scripts" / "flows_run.py"


def run_flows(mode: str, out: Path) -> list[dict]:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), mode, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return [json.loads((out / f"{mode}-rank{rank}.json").read_text()) for rank in range(2)]


def test_zero3_is_registered_and_selected_by_name():
    assert "zero3" in StrategyRegistry
    trainer = pl.Trainer(strategy="zero3", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, Zero3Strategy)
    assert isinstance(trainer.strategy.precision_plugin, Zero3Precision)
    assert trainer.strategy.is_distributed
    assert trainer.strategy.config == Zero3Config()


def test_knobs_reach_the_config():
    strategy = Zero3Strategy(persistence_threshold=1e3, unit_modules="Block", timeout=timedelta(seconds=5))
    assert strategy.config.persistence_threshold == 1000
    assert strategy.config.unit_modules == ("Block",)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)
    assert trainer.strategy.config.timeout == timedelta(seconds=5)


@pytest.mark.parametrize(
    "knobs,words",
    [
        ({"persistance_threshold": 10}, ["unknown setting", "persistance_threshold", "persistence_threshold"]),
        ({"persistence_threshold": -1}, ["persistence_threshold", ">= 0"]),
        ({"persistence_threshold": 2.5}, ["persistence_threshold", "whole number"]),
        ({"unit_modules": [3]}, ["unit_modules", "nn.Module subclass"]),
        ({"unit_modules": []}, ["unit_modules"]),
        ({"process_group_backend": "tcp"}, ["process_group_backend", "gloo"]),
        ({"timeout": 30}, ["timeout", "timedelta"]),
        ({"sync_module_states": "yes"}, ["sync_module_states"]),
    ],
)
def test_bad_knobs_fail_with_the_setting_named(knobs, words):
    with pytest.raises(Zero3ConfigError) as error:
        Zero3Strategy(**knobs)
    for word in words:
        assert word in str(error.value)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-true", "64-true"])
def test_unsupported_precision_fails_at_trainer_construction(precision):
    with pytest.raises(UnsupportedPrecisionError, match="32-true"):
        pl.Trainer(strategy="zero3", accelerator="cpu", devices=2, precision=precision, logger=False)


def test_pytorch_lightning_registry_too():
    pytest.importorskip("pytorch_lightning")
    import pytorch_lightning

    assert "zero3" in pytorch_lightning.strategies.StrategyRegistry
    trainer = pytorch_lightning.Trainer(strategy="zero3", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, pytorch_lightning.strategies.ParallelStrategy)
    assert type(trainer.strategy).__name__ == "Zero3Strategy"
    assert lightning_zero3.Zero3Strategy is not type(trainer.strategy)  # the pytorch_lightning flavour


def test_fit_validate_test_predict_and_manual_optimization(tmp_path):
    ranks = run_flows("flows", tmp_path)
    seen = [set(r["seen"]) for r in ranks]
    assert not seen[0] & seen[1] and seen[0] | seen[1] == set(range(32))  # DistributedSampler injected
    for r in ranks:
        assert r["sampler"] == "DistributedSampler"
        assert r["rank_mean"] == pytest.approx(0.5)  # self.log(sync_dist=True) averaged over ranks
        assert r["validate"] == pytest.approx(ranks[0]["validate"])
        assert r["test"] == pytest.approx(ranks[0]["test"])
        assert r["predict_shapes"] == [[4, 16]] * 4
        assert r["block_sum"] == ranks[0]["block_sum"] != 0.0  # gathered_parameters in a hook
        assert r["weights_after"] == ranks[0]["weights_after"]  # full weights again after teardown
        assert r["manual"]["zero3"] == pytest.approx(r["manual"]["ddp"], rel=1e-6)


def test_touching_a_sharded_weight_in_a_hook_names_the_remedy(tmp_path):
    for r in run_flows("touch", tmp_path):
        assert r["error_type"] == "ParameterNotGatheredError"
        assert "model.blocks.1.fc.weight" in r["error"] and "gathered_parameters" in r["error"]


def test_model_without_trainable_parameters_is_refused(tmp_path):
    for r in run_flows("frozen", tmp_path):
        assert r["error_type"] == "NoTrainableParametersError"
        assert "requires_grad" in r["error"]


def test_checkpoint_resume_is_exact_and_loads_under_ddp(tmp_path):
    for r in run_flows("resume", tmp_path):
        assert r["first"] == r["straight"][:3]
        assert r["zero3"] == r["straight"][3:]  # bitwise: weights and Adam state restored exactly
        assert r["ddp"] == r["straight"][3:]  # the checkpoint holds full, unsharded state
