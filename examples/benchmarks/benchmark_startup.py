"""Time to the first step: from the fine-tuning command's start to the end of its first optimizer step.

Question: How long does a fine-tune of a pretrained checkpoint take to start under zero3, against DDP (from_pretrained), FSDP2 and DeepSpeed stage 3, and where does the time go?

    python examples/benchmarks/benchmark_startup.py              # a ~1B Llama, 4 CPU ranks, 3 runs
    python examples/benchmarks/benchmark_startup.py --quick      # a small Llama, 2 ranks, 1 run (what the test runs)

One checkpoint (``make_pretrained``: bf16 safetensors and a trained subword tokenizer, written once under
``--dir``) is fine-tuned by ``lightning-zero3 fit --config examples/configs/finetune_full.yaml`` (fp32,
AdamW, the sample jsonl rows) with ``--trainer.max_steps 1``, under each strategy:

  zero3      the job as written: ``from_config`` + ``load_pretrained`` in ``configure_model`` (meta device,
             each rank reads its own shards, nothing drawn for the checkpoint's tensors)
  ddp        Lightning's DDP, the model from ``from_pretrained`` on every rank (``startup_peers.FromPretrained``)
  fsdp2      Lightning's ``ModelParallelStrategy``: ``fully_shard`` per decoder layer and the root on the
             meta device, rank 0 reads the checkpoint and broadcasts it (``startup_peers.FSDP2FineTune``)
  deepspeed  Lightning's ``DeepSpeedStrategy`` (stage 3) with ``from_pretrained`` under ``zero.Init``

Each rank notes the wall-clock time of each phase (``startup_peers.StartupTimes``), from the moment this
script starts the command: ``launch`` (interpreter, imports, Lightning's launcher, the process group),
``build`` (``configure_model`` less its read), ``read`` (the checkpoint into the model: transformers'
``_load_pretrained_model``, FSDP2's broadcast, zero3's ``load_sources``, which runs in engine setup),
``setup`` (the strategy sharding the model and building the optimizer, less zero3's read), ``to batch``
(the data loader's first batch) and ``first step`` (forward, backward, optimizer step). Each column is the
slowest rank's. A strategy whose model states cannot fit in the host's memory is not run: its row says
how much it would need. The checkpoint's pages are dropped from the page cache before each run (as in
``benchmark_load.py``). Rows are medians over ``--runs``, the order of rows rotating between runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE), str(ROOT)]

from benchmark_load import add_run_arguments, checkpoint_files, drop_from_cache  # noqa: E402
from host_facts import describe_host, host_facts  # noqa: E402
from processes import add_peer_python_argument, deepspeed_missing, package_version  # noqa: E402

STRATEGIES = ("zero3", "ddp", "fsdp2", "deepspeed")
PEERS = "startup_peers"
MODULES = {"zero3": "examples.finetune.CausalLMFineTune", "ddp": f"{PEERS}.FromPretrained",
           "fsdp2": f"{PEERS}.FSDP2FineTune", "deepspeed": f"{PEERS}.FromPretrained"}  # fmt: skip
PHASES = ("launch", "build", "read", "setup", "to batch", "first step")


def strategy_args(strategy: str, ranks: int) -> list[str]:
    if strategy == "zero3":
        return ["--trainer.strategy", "zero3"]
    if strategy == "ddp":
        return ["--trainer.strategy", "ddp"]
    if strategy == "fsdp2":
        return ["--trainer.strategy", "lightning.pytorch.strategies.ModelParallelStrategy",
                "--trainer.strategy.data_parallel_size", str(ranks), "--trainer.strategy.tensor_parallel_size", "1"]  # fmt: skip
    return ["--trainer.strategy", "deepspeed_stage_3"]


def memory_needed(strategy: str, params: int, ranks: int) -> int:
    """Bytes the run's model states need on all ranks together (fp32 weights, gradients, AdamW's two
    moments: 16 bytes a parameter, whole on every DDP rank, divided among the ranks otherwise), plus the
    whole bf16 checkpoint that ``from_pretrained`` or FSDP2's rank 0 holds while reading."""
    states = 16 * params * (ranks if strategy == "ddp" else 1)
    return states + 2 * params * (ranks if strategy in ("ddp", "deepspeed") else 1 if strategy == "fsdp2" else 0)


def available_memory(accelerator: str, ranks: int) -> int:
    """The host's available memory; on GPUs, the devices' free memory together."""
    if accelerator == "cuda":
        import torch

        return sum(torch.cuda.mem_get_info(i)[0] for i in range(ranks))
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def run_once(strategy: str, checkpoint: Path, data: Path, args) -> dict | str:
    drop_from_cache(checkpoint_files(checkpoint))
    with tempfile.TemporaryDirectory() as tmp:
        command = [
            args.peer_python if strategy == "deepspeed" else sys.executable, "-m", "lightning_zero3.cli", "fit", "--config", str(ROOT / "examples" / "configs" / "finetune_full.yaml"),
            *strategy_args(strategy, args.ranks), "--trainer.accelerator", args.accelerator,
            "--trainer.devices", str(args.ranks), "--trainer.max_steps", "1",
            "--trainer.callbacks", json.dumps([{"class_path": f"{PEERS}.StartupTimes"}]), "--trainer.logger", "false",
            "--trainer.enable_checkpointing", "false", "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false", "--trainer.limit_val_batches", "0",
            "--model.class_path", MODULES[strategy], "--model.init_args.checkpoint", str(checkpoint),
            "--model.init_args.export_dir", "null", "--data.init_args.path", str(data),
            "--data.init_args.batch_size", str(args.batch_size),
        ]  # fmt: skip
        path = os.pathsep.join([str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")])
        env = {**os.environ, "PYTHONPATH": path, "PYTHONWARNINGS": "ignore", "STARTUP_OUT": tmp}
        env["STARTUP_T0"] = repr(time.time())
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout, cwd=tmp)
        except subprocess.TimeoutExpired:
            return f"failed: no first step within {args.timeout:.0f} s"
        files = [Path(tmp) / f"rank{r}.json" for r in range(args.ranks)]
        if not all(f.is_file() for f in files):
            lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
            errors = [line for line in lines if "Error" in line or "error:" in line]
            return "failed: " + (errors[-1] if errors else " / ".join(lines[-3:]))[:400]
        return {"ranks": [json.loads(f.read_text()) for f in files]}


def phases(ranks: list[dict]) -> dict[str, float]:
    """The phases of one run, each the slowest rank's (seconds)."""

    def slowest(f) -> float:
        return max(f(r) for r in ranks)

    return {
        "launch": slowest(lambda r: r["launched"]),
        "build": slowest(lambda r: r["configure_end"] - r["configure_start"] - r["read_in_configure"]),
        "read": slowest(lambda r: r["read_in_configure"] + r["read_in_setup"]),
        "setup": slowest(lambda r: r["engine_ready"] - r["configure_end"] - r["read_in_setup"]),
        "to batch": slowest(lambda r: r["first_batch"] - r["engine_ready"]),
        "first step": slowest(lambda r: r["first_step_end"] - r["first_batch"]),
        "total": slowest(lambda r: r["first_step_end"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "zero3-startup-benchmark"))
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    add_run_arguments(parser)
    parser.add_argument("--batch-size", type=int, default=1, help="rows per rank in the first step")
    parser.add_argument("--accelerator", choices=("cpu", "cuda"), default="cpu", help="cuda: one GPU per rank")
    parser.add_argument("--quick", action="store_true", help="a small Llama, 2 ranks, one run")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json", default="benchmark_startup.json")
    add_peer_python_argument(parser)
    args = parser.parse_args()
    if args.quick:
        args.layers, args.hidden, args.intermediate, args.heads, args.kv_heads = 2, 128, 344, 4, 2
        args.ranks, args.runs = min(args.ranks, 2), 1

    from examples.finetune import TinyLlama, make_pretrained
    from examples.finetune_assets import write_sample_data

    shape = TinyLlama(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads)  # fmt: skip
    directory = Path(args.dir)
    checkpoint = make_pretrained(str(directory / f"llama-{args.layers}x{args.hidden}"), shape)
    data = directory / "rows.jsonl"
    if not data.exists():
        write_sample_data(data)
    from safetensors import safe_open

    params = 0
    for file in checkpoint_files(checkpoint):
        with safe_open(file, "pt") as f:
            for key in f.keys():
                params += int(__import__("math").prod(f.get_slice(key).get_shape()))
    strategies = [s for s in args.strategies.split(",") if s]
    rows: dict[str, list] = {s: [] for s in strategies}
    for run in range(args.runs):
        for strategy in strategies[run % len(strategies) :] + strategies[: run % len(strategies)]:
            need, have = memory_needed(strategy, params, args.ranks), available_memory(args.accelerator, args.ranks)
            if strategy == "deepspeed" and deepspeed_missing(args.peer_python):
                outcome = deepspeed_missing(args.peer_python)
            elif need > have:
                where = "host memory" if args.accelerator == "cpu" else "GPU memory"
                outcome = (f"does not fit: its model states need about {need / 2**30:.1f} GiB of {where} on "
                           f"{args.ranks} ranks, {have / 2**30:.1f} GiB available")  # fmt: skip
            else:
                outcome = run_once(strategy, checkpoint, data, args)
            rows[strategy].append(outcome)
            said = f"{max(r['first_step_end'] for r in outcome['ranks']):.2f} s" if isinstance(outcome, dict) else outcome
            print(f"run {run + 1}/{args.runs} {strategy}: {said}", flush=True)
    args.deepspeed_version = package_version(args.peer_python, "deepspeed") if "deepspeed" in strategies else ""
    lines = table(rows, params, checkpoint, args)
    print(describe_host(host_facts()))
    print("\n".join(lines))
    Path(args.json).write_text(json.dumps({"rows": rows, "table": lines, "params": params}, indent=1))


def table(rows: dict[str, list], params: int, checkpoint: Path, args) -> list[str]:
    size = sum(f.stat().st_size for f in checkpoint_files(checkpoint))
    lines = [
        f"time to the first step: finetune_full.yaml on a {params / 1e6:,.0f}M-parameter Llama ({size / 1e6:,.0f} MB of bf16 "
        f"safetensors), fp32, {args.ranks} {args.accelerator.upper()} ranks, {args.batch_size} row(s) per rank; median of {args.runs} run(s); seconds",
        *([f"deepspeed {args.deepspeed_version} (run by {args.peer_python})"] if args.deepspeed_version else []),
        "",
        "strategy  | " + " | ".join(f"{p:>10}" for p in PHASES) + " |      total | x zero3",
        "----------+-" + "-+-".join("-" * 10 for _ in PHASES) + "-+------------+--------",
    ]
    medians = {}
    for strategy, runs in rows.items():
        good = [phases(r["ranks"]) for r in runs if isinstance(r, dict)]
        medians[strategy] = {k: statistics.median(g[k] for g in good) for k in good[0]} if good else runs[-1]
    base = medians.get("zero3")
    for strategy, m in medians.items():
        if isinstance(m, str):
            lines.append(f"{strategy:<9} | {m[:400]}")
            continue
        versus = f"{m['total'] / base['total']:.2f}" if isinstance(base, dict) else "-"
        cells = " | ".join(f"{m[p]:10.2f}" for p in PHASES)
        lines.append(f"{strategy:<9} | {cells} | {m['total']:10.2f} | {versus:>7}")
    return lines


if __name__ == "__main__":
    main()
