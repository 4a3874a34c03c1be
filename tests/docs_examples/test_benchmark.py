"""examples/benchmarks/benchmark.py runs every strategy on a small model and writes a table and JSON of sane figures."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_benchmark_table_and_json(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(ROOT / "examples" / "benchmarks" / "benchmark.py"), "--strategies", "zero3,ddp,fsdp2,deepspeed,zero3_fabric,single"]
    cmd += ["--runs", "1", "--steps", "5", "--warmup", "2", "--n-layer", "2", "--n-embd", "64", "--n-head", "2"]
    cmd += ["--block-size", "32", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(out.read_text())
    rows = summary["rows"]
    assert {"zero3", "ddp", "fsdp2", "zero3_fabric"} <= rows.keys(), summary["skipped"]  # why a strategy has no row
    if importlib.util.find_spec("deepspeed") is None:
        assert "not installed" in summary["skipped"]["deepspeed"]
    else:
        assert "deepspeed" in rows
    assert "one device" in summary["skipped"]["single"]  # plain Lightning is the reference at --devices 1 only
    for name, row in rows.items():
        assert row["step_time_s"] > 0 and row["tokens_per_s"] > 0 and row["peak_rss_bytes"] > 2**20
        assert row["model_state_bytes"] > 0
        assert row["cpu_s_per_step"] > 0  # CPU seconds of one process, all threads (a figure, not a bound)
        assert row["loss_max_rel_diff_vs_ddp"] <= 1e-4, name  # every peer trains the same model alike
    assert rows["ddp"]["step_time_x_ddp"] == 1.0
    assert 0 <= rows["zero3"]["exposed_comm_share"] <= 1
    assert "x DDP" in done.stdout and "zero3" in done.stdout
    # the host's facts go beside the figures (one host's ratio is one sample)
    host = summary["host"]
    assert host["cores"] >= 1 and host["torch"] and host["python"]
    assert f"{host['cores']} cores" in done.stdout and "host: " in done.stdout


def test_a_failed_exit_fails_the_run_unless_the_worker_may_fail_at_exit(tmp_path):
    sys.path.insert(0, str(ROOT / "examples" / "benchmarks"))
    from processes import read_result

    result = tmp_path / "result.json"
    assert read_result(result, 0, "Traceback: boom", exit_may_fail=True).startswith("failed (exit 0): Traceback")
    result.write_text(json.dumps({"tokens_per_s": 3.0}))
    assert read_result(result, 0, "") == {"tokens_per_s": 3.0}
    aborted = "[rank 0] terminate called without an active exception"
    assert read_result(result, -6, aborted) == f"failed (exit -6): {aborted}"  # zero3's own workers exit cleanly
    outcome = read_result(result, -6, aborted, exit_may_fail=True)  # DeepSpeed's ranks: the result counts
    assert outcome["tokens_per_s"] == 3.0 and outcome["exit"].startswith("exit -6 after its result was written")



def test_deepspeed_rows_run_under_the_peer_interpreter_named(tmp_path, monkeypatch):
    """``--peer-python`` (or ``ZERO3_PEER_PYTHON``) names the interpreter of DeepSpeed's rows; one without
    DeepSpeed gives a row saying so, and the versions come from that interpreter, not this one."""
    import argparse

    import torch

    sys.path.insert(0, str(ROOT / "examples" / "benchmarks"))
    from processes import add_peer_python_argument, deepspeed_missing, package_version

    assert package_version(sys.executable, "torch") == torch.__version__
    nowhere = str(tmp_path / "no-python")
    assert package_version(nowhere, "torch") == ""
    assert "DeepSpeed is not installed for " + nowhere in deepspeed_missing(nowhere)
    monkeypatch.setenv("ZERO3_PEER_PYTHON", nowhere)
    parser = argparse.ArgumentParser()
    add_peer_python_argument(parser)
    assert parser.parse_args([]).peer_python == nowhere
    assert parser.parse_args(["--peer-python", "/x/python"]).peer_python == "/x/python"

@pytest.mark.parametrize("family", ["llama", "mixtral", "llava_next"])
def test_load_benchmark_quick_mode_loads_alike_and_reads_the_checkpoint_once(tmp_path, family):
    """``examples/benchmarks/benchmark_load.py --quick``: every row loads the same model (same loss), and zero3's ranks
    each read only their part of the checkpoint (Mixtral's: per-expert files into fused experts; LLaVA-Next's:
    the Hub's names renamed; two rows each)."""
    out = tmp_path / "load.json"
    methods = "zero3,zero3_drawn,init_then_zero3,fsdp2" + (",deepspeed" if importlib.util.find_spec("deepspeed") else "")
    if family != "llama":
        methods = "zero3,init_then_zero3"
    cmd = [sys.executable, str(ROOT / "examples" / "benchmarks" / "benchmark_load.py"), "--quick", "--methods", methods,
           "--family", family, "--dir", str(tmp_path / "checkpoint"), "--json", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == set(methods.split(","))
    checkpoint = sum(f.stat().st_size for f in (tmp_path / "checkpoint").rglob("*.safetensors"))
    losses = {}
    for method, runs in rows.items():
        (run,) = runs
        assert isinstance(run, dict), run  # a row that failed says why in its place
        losses[method] = run["ranks"][0]["loss"]
        assert all(r["seconds"] > 0 and r["held_bytes"] > 0 for r in run["ranks"])
    assert len(set(losses.values())) == 1, losses
    # Every rank reading it all would be 2x. Parameters under ``persistence_threshold`` (the small model's
    # attention projections and norms: 0.4M of its 1.7M) are whole on every rank, so each rank reads them
    # (bf16 in the file); O_DIRECT reads whole 4 KiB blocks around each rank's piece of the 2-256 KiB
    # tensors (the 1B model of the README, nothing replicated but norms, reads 1.00x). ``read_bytes`` counts
    # every disk read of the process: on a fresh machine, pages of the program's own files that the warm-up
    # left cold add up to 1 MiB (0.5 MiB seen), against the 3.4 MiB a second full read would add.
    zero3 = rows["zero3"][0]["ranks"]
    replicated = zero3[0]["replicated_elements"] * 2
    once = checkpoint + (len(zero3) - 1) * replicated
    assert sum(r["read_bytes"] for r in zero3) <= 1.1 * once + 2**20 < len(zero3) * checkpoint
    assert "x bound" in done.stdout and "zero3" in done.stdout


def test_startup_benchmark_quick_mode_times_every_phase_to_the_first_step(tmp_path):
    """``examples/benchmarks/benchmark_startup.py --quick``: the fine-tuning job to its first optimizer step under
    each strategy through ``lightning-zero3 fit``; every rank notes every phase, in order; zero3 reads the
    checkpoint in engine setup, the peers in ``configure_model``; DeepSpeed's row says why it cannot run."""
    out = tmp_path / "startup.json"
    cmd = [sys.executable, str(ROOT / "examples" / "benchmarks" / "benchmark_startup.py"), "--quick", "--dir",
           str(tmp_path / "data"), "--json", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    order = ("launched", "configure_start", "configure_end", "engine_ready", "first_batch", "first_step_end")
    for strategy in ("zero3", "ddp", "fsdp2"):
        (run,) = rows[strategy]
        assert isinstance(run, dict), run
        for rank in run["ranks"]:
            marks = [rank[name] for name in order]
            assert marks == sorted(marks) and marks[0] > 0, (strategy, rank)
        reads = run["ranks"][0]
        if strategy == "zero3":
            assert reads["read_in_setup"] > 0 and reads["read_in_configure"] == 0
        else:
            assert reads["read_in_configure"] > 0 and reads["read_in_setup"] == 0
    (deepspeed,) = rows["deepspeed"]
    # Lightning's DeepSpeedStrategy needs CUDA GPUs (and the deepspeed package)
    assert isinstance(deepspeed, str) and ("CUDA" in deepspeed or "DeepSpeed" in deepspeed), deepspeed
    assert "first step" in done.stdout and "x zero3" in done.stdout


def test_benchmark_compiles_every_block_of_the_lightning_rows(tmp_path):
    """``--compile``: zero3, DDP and FSDP2 train the same model with each block compiled in place (their losses
    agree), the table says so, and the rows that are not Lightning Trainer's say why they are left out."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(ROOT / "examples" / "benchmarks" / "benchmark.py"), "--compile", "--strategies",
           "zero3,ddp,fsdp2,zero3_fabric", "--runs", "1", "--steps", "4", "--warmup", "2", "--n-layer", "2",
           "--n-embd", "32", "--n-head", "2", "--block-size", "16", "--json", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["config"]["compile"] is True and "every block compiled" in done.stdout
    assert {"zero3", "ddp", "fsdp2"} == summary["rows"].keys()
    assert "Lightning Trainer's rows only" in summary["skipped"]["zero3_fabric"]
    for name, row in summary["rows"].items():
        assert row["loss_max_rel_diff_vs_ddp"] <= 1e-4, name


def test_profile_step_charges_the_step_to_zero3s_parts():
    """``examples/benchmarks/profile_step.py``: every part of the table is measured, the parts together are the profiled
    steps' own time (each function's, and each C function's split over its callers, charged once), and the
    zero3 parts make Python calls."""
    sys.path.insert(0, str(ROOT / "examples" / "benchmarks"))
    import profile_step

    figures = profile_step.main(["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "16",
                                 "--steps", "4", "--warmup", "2", "--zero3", "persistence_threshold=0",
                                 "--top", "3"])  # fmt: skip
    assert figures["units"] == 3  # the root and two blocks
    assert set(figures["seconds"]) == set(profile_step.ORDER)
    assert all(figures["seconds"][part] > 0 for part in ("hooks", "gather / release", "reductions", "not zero3"))
    # the parts partition the profile: their sum is its total own time (float sums apart), however fast
    assert sum(figures["seconds"].values()) == pytest.approx(figures["profiled_seconds"], rel=1e-6)
    assert figures["calls"]["hooks"] > 0 and len(figures["top"]) == 3


def test_step_phases_splits_each_step_of_zero3_and_ddp_into_forward_backward_and_optimizer():
    """``examples/benchmarks/step_phases.py``: a figure for every strategy, phase and run (how they compare is the
    script's to print, not this test's to bound)."""
    sys.path.insert(0, str(ROOT / "examples" / "benchmarks"))
    import step_phases

    results = step_phases.main(["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "16",
                                "--steps", "4", "--warmup", "2", "--runs", "1", "--strategies", "zero3,ddp"])  # fmt: skip
    assert set(results) == {"zero3", "ddp"}
    for strategy, runs in results.items():
        (run,) = runs
        assert set(run) == {phase for phase, _, _ in step_phases.PHASES}
        for phase, (wall, cpu, preempted) in run.items():
            assert wall > 0 and cpu > 0 and preempted >= 0, (strategy, phase)


def test_collective_cost_times_every_way_zero3_and_ddp_move_a_unit():
    cmd = [sys.executable, str(ROOT / "examples" / "benchmarks" / "collective_cost.py"), "--numel", "65536", "--repeats", "3"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {line.split("|")[0].strip(): line.split("|")[1:] for line in done.stdout.splitlines() if line.count("|") == 2}
    for way in ("all_gather", "swap shards", "reduce_scatter", "all_reduce + slice", "swap halves", "all_reduce"):
        wall, cpu = (float(x) for x in rows[way])
        assert wall > 0 and cpu >= 0, way
    assert "per unit of 65536 fp32 elements and step, 2 ranks: zero3" in done.stdout


def test_single_device_row_is_plain_lightning_beside_zero3_at_world_size_one(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(ROOT / "examples" / "benchmarks" / "benchmark.py"), "--devices", "1", "--strategies", "zero3,single"]
    cmd += ["--runs", "1", "--steps", "4", "--warmup", "1", "--n-layer", "2", "--n-embd", "64", "--n-head", "2"]
    cmd += ["--block-size", "32", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    single = rows["single"]
    assert single["step_time_s"] > 0 and single["model_state_bytes"] > 0 and single["peak_rss_bytes"] > 2**20
    assert len(single["losses"]) == 4 and all(0 < loss < 10 for loss in single["losses"])
    table = done.stdout[done.stdout.index("strategy |") :]
    assert "nan" not in table and "| n/a" in table  # no DDP row: its ratios are "n/a"


def test_finetune_benchmark_data_follows_alpacas_lengths_and_padding_is_counted_in_every_layout(tmp_path):
    """``benchmark_finetune.py``'s generated rows have the lengths it states (Alpaca's prompt and response
    medians and 95th percentiles, in the recipe's tokens), and its padding count finds the attention mask's
    zeros of a padded batch and only the tail of a packed one."""
    transformers = pytest.importorskip("transformers")
    sys.path.insert(0, str(ROOT / "examples" / "benchmarks"))
    from benchmark_finetune import ALPACA, padding_positions, write_rows

    from examples.finetune_assets import train_tokenizer
    from examples.sft_data import IGNORE, collate, collate_packed, pack, read_rows, tokenize

    train_tokenizer(tmp_path / "tokenizer")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "tokenizer")
    rows = [tokenize(row, tokenizer, 512) for _, row in read_rows(write_rows(tmp_path / "rows.jsonl", tokenizer, 600))]
    responses = sorted(sum(label != IGNORE for label in labels) - 1 for _, labels in rows)  # less the EOS
    median, p95 = ALPACA["response"]
    assert abs(responses[300] - median) <= 0.15 * median and abs(responses[570] - p95) <= 0.25 * p95
    padded = collate(rows[:4], tokenizer.pad_token_id)
    assert padding_positions(padded, tokenizer.pad_token_id) == padded["input_ids"].numel() - sum(len(r[0]) for r in rows[:4])
    packs = pack(rows[:12], 512)
    packed = collate_packed(packs, tokenizer.pad_token_id)
    assert padding_positions(packed, tokenizer.pad_token_id) == packed["input_ids"].numel() - sum(len(r[0]) for r in rows[:12])
