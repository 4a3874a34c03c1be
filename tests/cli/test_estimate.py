"""``lightning-zero3 estimate`` against paper (Llama-2-70B) and against the measured peaks of the main job and of the
full fine-tuning job (the main job's ``estimate`` command and the fine-tuning job's ``estimate`` and ``fit`` commands
that docs/will-it-fit.md prints)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_zero3.cli.estimate.command import run

ROOT = Path(__file__).resolve().parents[2]
MAIN_JOB = ROOT / "examples" / "configs" / "gpt_zero3.yaml"
KEYS = {"plan", "device_bytes_per_rank", "model_state_bytes_per_rank", "host_bytes_per_node", "nvme_bytes", "fits",
        "selected"}  # fmt: skip
LLAMA_2_70B = {"model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
               "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 32000,
               "max_position_embeddings": 4096, "tie_word_embeddings": False}  # fmt: skip


def test_llama_2_70b_on_8_x_80gb_needs_offload_and_some_plan_fits(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_2_70B))
    run(["--hf", str(tmp_path / "config.json"), "--devices", "8", "--device-memory", "80GB", "--json"])
    rows = {r["plan"]: r for r in json.loads(capsys.readouterr().out)}
    none = rows["none"]
    assert none["params"] == 68_976_648_192
    assert none["model_state_bytes_per_rank"] == pytest.approx(16 * 68.98e9 / 8, rel=0.02)  # 138 GB
    assert none["fits"] is False
    assert any(r["fits"] for r in rows.values())


def test_the_main_jobs_estimate_is_within_15_percent_of_its_measured_peak(tmp_path, capsys):
    steps = ["--trainer.max_steps", "20", "--trainer.val_check_interval", "10",
             "--trainer.logger.init_args.save_dir", str(tmp_path)]  # fmt: skip
    rows = run(["--config", str(MAIN_JOB), "--json", *steps])
    printed = capsys.readouterr().out
    assert json.loads(printed[printed.index("[") :]) == rows  # the JSON for scripts
    assert all(KEYS <= set(row) for row in rows)
    assert [r["plan"] for r in rows if r["selected"]] == ["none"]  # the job's own settings: no offload
    estimate = rows[0]["device_bytes_per_rank"]

    peaks = [r["peak_rss"] for r in _fit(tmp_path / "peaks", *steps)]
    print(f"\nestimate {estimate / 2**20:.0f} MiB per rank; measured " + ", ".join(f"{p / 2**20:.0f}" for p in peaks))
    assert len(peaks) == 2
    for peak in peaks:
        assert estimate == pytest.approx(peak, rel=0.15)


FINETUNE_JOB = ROOT / "examples" / "configs" / "finetune_full.yaml"


def test_the_fine_tuning_jobs_estimate_is_within_15_percent_of_its_measured_peak(tmp_path, monkeypatch, capsys):
    """The full fine-tuning job on its sample model (written under runs/ of the working directory by the
    module's prepare_data, which the estimate runs as fit does): 6 steps, 2 CPU ranks, no export."""
    monkeypatch.chdir(tmp_path)
    steps = ["--trainer.max_steps", "6", "--model.init_args.export_dir", "null"]
    rows = run(["--config", str(FINETUNE_JOB), "--json", *steps])
    capsys.readouterr()
    assert [r["plan"] for r in rows if r["selected"]] == ["none"]
    estimate = next(r for r in rows if r["selected"])["device_bytes_per_rank"]

    peaks = [r["peak_rss"] for r in _fit(tmp_path / "peaks", *steps, config=FINETUNE_JOB, cwd=tmp_path)]
    print(f"\nestimate {estimate / 2**20:.0f} MiB per rank; measured " + ", ".join(f"{p / 2**20:.0f}" for p in peaks))
    assert len(peaks) == 2
    for peak in peaks:
        assert estimate == pytest.approx(peak, rel=0.15)


def _fit(out: Path, *overrides: str, config: Path = MAIN_JOB, cwd: Path = ROOT) -> list[dict]:
    """``lightning-zero3 fit`` of a job's YAML (the main job's unless said) with ``overrides``: each rank's peak
    RSS, losses and plan."""
    cmd = [sys.executable, "-m", "lightning_zero3.cli", "fit", "--config", str(config), *overrides,
           "--trainer.callbacks+=peak_rss.PeakRSS"]  # fmt: skip
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "ZERO3_PEAK_RSS_DIR": str(out),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "helpers"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=cwd, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]


#: a GPT of 40M parameters (8 layers, 640 wide): 640 MB of model states, 320 MB per rank at 2 ranks; a short
#: run (6 steps of 2 x 64 tokens), no validation
BIG_GPT = ["--model.init_args.cfg.n_layer", "8", "--model.init_args.cfg.n_embd", "640", "--model.init_args.cfg.block_size",
           "64", "--data.init_args.block_size", "64", "--data.init_args.batch_size", "2", "--trainer.max_steps", "6",
           "--trainer.val_check_interval", "100", "--trainer.limit_val_batches", "0"]  # fmt: skip
BUDGET = 800_000_000  # below what the GPT needs without offload (measured 1.09-1.15 GB per rank)


def test_auto_offload_takes_an_nvme_plan_within_its_budget_and_trains_as_without_offload(tmp_path):
    auto = _fit(tmp_path / "auto", *BIG_GPT, "--trainer.logger.init_args.save_dir", str(tmp_path),
                "--trainer.strategy.class_path", "lightning_zero3.Zero3Strategy",
                "--trainer.strategy.init_args.offload_optimizer", "auto", "--trainer.strategy.init_args.offload_params",
                "auto", "--trainer.strategy.init_args.nvme_path", str(tmp_path / "swap"),
                "--trainer.strategy.init_args.memory_budget", str(BUDGET))  # fmt: skip
    resident = _fit(tmp_path / "resident", *BIG_GPT, "--trainer.logger.init_args.save_dir", str(tmp_path))
    print("\n" + auto[0]["plan"]["why"])
    for a, r in zip(auto, resident, strict=True):
        print(f"rank {a['rank']}: peak {a['peak_rss'] / 1e6:.0f} MB with {a['plan']['offload_optimizer']}/"
              f"{a['plan']['offload_params']} (budget {BUDGET / 1e6:.0f} MB), {r['peak_rss'] / 1e6:.0f} MB without offload")
        assert r["peak_rss"] > BUDGET  # the budget is below what no offload needs
        assert a["plan"]["offload_optimizer"] == "nvme"
        assert a["losses"] == pytest.approx(r["losses"], rel=1e-5)  # Adam's fused CPU kernel: 1 ulp
    assert len(auto) == 2
    assert all(a["peak_rss"] <= BUDGET * 1.05 for a in auto)  # issue 48's bar


def test_a_later_run_with_the_same_auto_settings_reuses_the_engine_with_the_plan_it_took(tmp_path):
    import torch
    from gpt import GPT, GPTConfig

    from lightning_zero3 import Zero3Config, Zero3Engine

    auto = Zero3Config(offload_optimizer="auto", offload_params="auto", nvme_path=str(tmp_path), memory_budget="1TB")
    engine = Zero3Engine(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)), auto)
    assert (engine.config.offload_optimizer, engine.config.offload_params) == (None, None)  # "none" fits 1 TB
    dtypes, device = engine.dtypes, torch.device("cpu")
    assert engine.reuse_problems(auto, dtypes, device, 1) == []
    assert engine.resolved(auto).offload_optimizer is None
    fixed = Zero3Config(offload_optimizer="cpu")
    assert any("offload_optimizer='cpu'" in p for p in engine.reuse_problems(fixed, dtypes, device, 1))

    from lightning_zero3.checkpoint import save_sharded_checkpoint

    save_sharded_checkpoint(tmp_path / "ckpt", engine, [], {})
    recorded = json.loads((tmp_path / "ckpt" / "offload_plan.json").read_text())
    assert recorded["plan"] == "none" and recorded["asked"]["offload_optimizer"] == "auto"


LLAMA_7B = {**LLAMA_2_70B, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 32, "intermediate_size": 11008}  # fmt: skip


def test_the_gpu_fine_tuning_configs_header_states_the_estimators_figures(tmp_path, capsys):
    """``examples/configs/finetune_gpu.yaml`` states per-GPU (and host) memory for Llama 7B and 70B on 8 x 80 GB:
    those are what ``estimate --hf`` gives now (GB = 10^9 bytes, one decimal; host rounded to the GB)."""
    header = (ROOT / "examples" / "configs" / "finetune_gpu.yaml").read_text()
    stated = {"7b": [("none", False), ("optimizer->cpu", True)],  # (plan, the header states its host GB)
              "70b": [("none", False), ("optimizer->cpu", True), ("all->cpu", True)]}  # fmt: skip
    for name, config in (("7b", LLAMA_7B), ("70b", LLAMA_2_70B)):
        (tmp_path / f"{name}.json").write_text(json.dumps(config))
        run(["--hf", str(tmp_path / f"{name}.json"), "--devices", "8", "--device-memory", "80GB", "--json"])
        rows = {r["plan"]: r for r in json.loads(capsys.readouterr().out)}
        for plan, with_host in stated[name]:  # the figures come from the estimator, the header must carry them
            device = round(rows[plan]["device_bytes_per_rank"] / 1e9, 1)
            assert f"{device} GB/GPU" in header, (name, plan, device)
            if with_host:
                host = round(rows[plan]["host_bytes_per_node"] / 1e9)
                assert f"{host} GB host" in header, (name, plan, host)
