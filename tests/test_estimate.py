"""``lightning-zero3 estimate`` against paper (Llama-2-70B) and against the measured peak of the main job."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_zero3.estimate.command import run

ROOT = Path(__file__).resolve().parents[1]
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

    cmd = [sys.executable, "-m", "lightning_zero3.cli", "fit", "--config", str(MAIN_JOB), *steps,
           "--trainer.callbacks+=peak_rss.PeakRSS"]  # fmt: skip
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "ZERO3_PEAK_RSS_DIR": str(tmp_path / "peaks"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    peaks = [json.loads(f.read_text())["peak_rss"] for f in sorted((tmp_path / "peaks").glob("rank*.json"))]
    print(f"\nestimate {estimate / 2**20:.0f} MiB per rank; measured " + ", ".join(f"{p / 2**20:.0f}" for p in peaks))
    assert len(peaks) == 2
    for peak in peaks:
        assert estimate == pytest.approx(peak, rel=0.15)
