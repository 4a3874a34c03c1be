"""Fine-tuning throughput of padded, length-grouped and packed batches on instruction data of realistic lengths.

Question: How many response tokens per second does the fine-tuning recipe train when rows are right-padded
to the longest in the batch (the default), grouped by length, or packed, and how much of each batch is padding?

    python examples/benchmarks/benchmark_finetune.py              # 3 runs of each, 2 CPU ranks
    python examples/benchmarks/benchmark_finetune.py --quick      # a small model, 1 run of a few steps

Every run is the fine-tuning job of ``examples/configs/finetune_full.yaml`` (``lightning-zero3 fit``, zero3,
``--devices`` CPU ranks) on the same small Llama (written by ``make_pretrained``, subword tokenizer trained
locally), the same ``--max-length``, and the same generated Alpaca-form jsonl:

- padded: ``--batch-size`` rows a rank, right-padded to the longest of the batch (the recipe's default);
- grouped: the same, with ``group_by_length: true``;
- packed: ``packing: true``, ``--pack-batch-size`` packs of up to ``--max-length`` tokens a rank (the
  default, 2 packs of 512, holds about as many rows as 8 padded rows: the same rows a step, on average).

The data's lengths follow Stanford Alpaca's (``ALPACA``): each row's prompt (instruction and input) and
response lengths are drawn from log-normal distributions with Alpaca's median and 95th percentile, in
tokens, and filled with words until this tokenizer gives that many tokens; the rows then go through the
recipe's Alpaca template. The table gives the generated rows' own lengths as the recipe tokenizes them.

Measured per run, from a callback in every rank: the wall time of the steps after ``--warmup`` (from the
end of the last warm-up step to the end of the last step, data loading included), the response tokens
those steps trained on all ranks (labels other than -100, each predicted from the token before it), the
share of the batches' positions that hold padding rather than a row's token, and each rank's whole-run peak
resident memory (``VmHWM``). Median of ``--runs`` runs; the speed-up is against padded, in the same run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import lightning.pytorch as pl

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT), str(BENCHMARKS)]

#: Stanford Alpaca (tatsu-lab/stanford_alpaca, 52,002 rows), in Llama tokens: the median and 95th percentile of
#: a row's prompt (instruction and input, without the template) and of its response (output). Estimated from
#: 84 rows read at two offsets of the repository's data/alpaca_5000.json (a random 5,000-row subset), counted
#: in words and taken as 1.3 Llama tokens a word; the log-normal fits' means (prompt 24.6, response 62 tokens)
#: agree with the means reported for the whole set by Wang et al. 2023 (Tulu, table 1: 27.8 and 64.6).
ALPACA = {"prompt": (17, 70), "response": (46, 165)}
MODES = ("padded", "grouped", "packed")
Z95 = 1.6449  # the standard normal's 95th percentile


def draw_length(rng: random.Random, median: float, p95: float) -> int:
    """A length from the log-normal with that median and 95th percentile (at least 1)."""
    sigma = math.log(p95 / median) / Z95
    return max(1, round(rng.lognormvariate(math.log(median), sigma)))


def write_rows(path: Path, tokenizer, rows: int, seed: int = 0) -> Path:
    """``rows`` Alpaca rows whose prompt and response lengths (in ``tokenizer``'s tokens) follow ``ALPACA``."""
    from examples.finetune_assets import FACTS

    words = sorted({w for pair in FACTS for text in pair for w in text.split()})
    cost = {w: len(tokenizer(" " + w, add_special_tokens=False)["input_ids"]) for w in words}
    rng = random.Random(seed)

    def text_of(tokens: int) -> str:
        chosen, used = [], 0
        while used < tokens:
            chosen.append(rng.choice(words))
            used += cost[chosen[-1]]
        return " ".join(chosen)

    with open(path, "w") as out:
        for _ in range(rows):
            prompt, response = (draw_length(rng, *ALPACA[part]) for part in ("prompt", "response"))
            split = rng.randint(1, prompt)  # instruction and input
            row = {"instruction": text_of(split), "input": text_of(prompt - split) if prompt > split else "",
                   "output": text_of(response)}  # fmt: skip
            out.write(json.dumps(row) + "\n")
    return path


def padding_positions(batch: dict, pad_id: int) -> int:
    """Positions of a batch that hold padding: the attention mask's zeros, or a pack's tail after its last row
    (where the position ids restart over pad tokens)."""
    if "attention_mask" in batch:
        return int((batch["attention_mask"] == 0).sum())
    padding = 0
    for ids, positions in zip(batch["input_ids"], batch["position_ids"]):
        tail = int((positions == 0).nonzero()[-1])
        padding += len(ids) - tail if bool((ids[tail:] == pad_id).all()) else 0
    return padding


class Throughput(pl.Callback):
    """Each rank's trained tokens, padding and wall time after ``warmup`` steps, and its peak memory, written to
    ``$BENCH_FINETUNE_OUT/rank<N>.json`` when ``fit`` ends."""

    def __init__(self, warmup: int = 3) -> None:
        self.warmup, self.steps, self.trained, self.positions, self.padding = warmup, 0, 0, 0, 0
        self.start = self.end = 0.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        import time

        self.steps += 1
        if self.steps == self.warmup:
            self.start = time.perf_counter()
        elif self.steps > self.warmup:
            self.end = time.perf_counter()
            self.trained += int((batch["labels"][:, 1:] != -100).sum())
            self.positions += batch["input_ids"].numel()
            self.padding += padding_positions(batch, trainer.datamodule.pad_id)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        from processes import peak_rss

        record = {"seconds": self.end - self.start, "trained": self.trained, "positions": self.positions,
                  "padding": self.padding, "steps": self.steps - self.warmup, "peak_rss": peak_rss()}  # fmt: skip
        Path(os.environ["BENCH_FINETUNE_OUT"], f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def run(mode: str, args: argparse.Namespace, checkpoint: Path, data: Path, out: Path) -> dict:
    """One fine-tuning job; its ranks' records summed (tokens, positions) or listed (memory)."""
    data_args = {"padded": [], "grouped": ["--data.init_args.group_by_length", "true"],
                 "packed": ["--data.init_args.packing", "true"]}[mode]  # fmt: skip
    batch = args.pack_batch_size if mode == "packed" else args.batch_size
    callback = [{"class_path": "benchmark_finetune.Throughput", "init_args": {"warmup": args.warmup}}]
    cmd = [
        sys.executable, "-m", "lightning_zero3.cli", "fit", "--config", str(ROOT / "examples/configs/finetune_full.yaml"),
        "--trainer.devices", str(args.devices), "--trainer.max_steps", str(args.warmup + args.steps),
        "--trainer.limit_val_batches", "0", "--trainer.logger", "false", "--trainer.enable_checkpointing", "false",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--trainer.callbacks", json.dumps(callback), "--model.init_args.checkpoint", str(checkpoint),
        "--model.init_args.export_dir", "null", "--data.init_args.path", str(data),
        "--data.init_args.max_length", str(args.max_length), "--data.init_args.batch_size", str(batch), *data_args,
    ]  # fmt: skip
    out.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env.update(BENCH_FINETUNE_OUT=str(out), PYTHONPATH=os.pathsep.join([str(ROOT), str(BENCHMARKS)]), PYTHONWARNINGS="ignore")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=out, timeout=args.timeout)
    ranks = [out / f"rank{r}.json" for r in range(args.devices)]
    if done.returncode != 0 or not all(file.exists() for file in ranks):
        raise RuntimeError(f"{mode} run failed (exit {done.returncode}):\n{(done.stderr or done.stdout)[-3000:]}")
    records = [json.loads(file.read_text()) for file in ranks]
    seconds = max(r["seconds"] for r in records)
    total = {key: sum(r[key] for r in records) for key in ("trained", "positions", "padding")}
    return {"tokens_per_s": total["trained"] / seconds, "padding_share": total["padding"] / total["positions"],
            "positions_per_step": total["positions"] / records[0]["steps"], "step_s": seconds / records[0]["steps"],
            "peak_rss": [r["peak_rss"] for r in records]}  # fmt: skip


def data_lengths(data: Path, tokenizer, max_length: int) -> dict:
    """The generated rows' lengths as the recipe tokenizes them (template included), and their responses'."""
    from examples.sft_data import IGNORE, read_rows, tokenize

    rows = [tokenize(row, tokenizer, max_length) for _, row in read_rows(data)]
    whole = sorted(len(ids) for ids, _ in rows)
    response = sorted(sum(label != IGNORE for label in labels) for _, labels in rows)

    def quantile(values, q):
        return values[min(len(values) - 1, int(q * len(values)))]

    return {"rows": len(rows), "median": quantile(whole, 0.5), "p95": quantile(whole, 0.95), "max": whole[-1],
            "response_median": quantile(response, 0.5), "response_p95": quantile(response, 0.95)}  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="timed steps a run, after the warm-up")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--rows", type=int, default=1000)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8, help="rows a rank (padded, grouped)")
    p.add_argument("--pack-batch-size", type=int, default=2, help="packs a rank (packed)")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--quick", action="store_true", help="a small model, 1 run of 2 timed steps, 200 rows")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.runs, args.steps, args.warmup, args.rows, args.hidden_size, args.layers = 1, 2, 1, 200, 64, 2
    return args


def main(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    from examples.finetune import TinyLlama, make_pretrained
    from host_facts import host_facts

    scratch = Path(tempfile.mkdtemp(prefix="bench-finetune-"))
    shape = TinyLlama(hidden_size=args.hidden_size, intermediate_size=args.hidden_size * 11 // 4,
                      num_hidden_layers=args.layers, max_position_embeddings=args.max_length)  # fmt: skip
    checkpoint = make_pretrained(str(scratch / "model"), shape)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    data = write_rows(scratch / "alpaca-lengths.jsonl", tokenizer, args.rows)
    lengths = data_lengths(data, tokenizer, args.max_length)
    runs = {mode: [] for mode in MODES}
    for attempt in range(args.runs):
        for mode in MODES:  # interleaved, so that a slow spell of the machine falls on every mode alike
            runs[mode].append(run(mode, args, checkpoint, data, scratch / f"{mode}-{attempt}"))
            print(f"run {attempt + 1}/{args.runs} {mode}: {runs[mode][-1]['tokens_per_s']:.0f} trained tokens/s", flush=True)
    rows = {}
    for mode, results in runs.items():
        rows[mode] = {key: statistics.median(r[key] for r in results)
                      for key in ("tokens_per_s", "padding_share", "positions_per_step", "step_s")}  # fmt: skip
        rows[mode]["peak_rss"] = [statistics.median(r["peak_rss"][rank] for r in results) for rank in range(args.devices)]
    for row in rows.values():
        row["x_padded"] = row["tokens_per_s"] / rows["padded"]["tokens_per_s"]
    summary = {"host": host_facts(), "args": {k: str(v) for k, v in vars(args).items()}, "data": lengths, "rows": rows,
               "runs": runs, "alpaca": ALPACA}  # fmt: skip
    print_table(summary, args)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return summary


def print_table(summary: dict, args: argparse.Namespace) -> None:
    from host_facts import describe_host

    d = summary["data"]
    print(f"\n{args.devices} CPU ranks, zero3, fp32; Llama {args.layers} layers x {args.hidden_size}; max_length {args.max_length}; "
          f"median of {args.runs} runs of {args.steps} timed steps")  # fmt: skip
    print(f"data: {d['rows']} Alpaca-form rows, tokens a row median {d['median']}, p95 {d['p95']}, max {d['max']} "
          f"(responses: median {d['response_median']}, p95 {d['response_p95']})")  # fmt: skip
    print(describe_host(summary["host"]))
    ranks = " | ".join(f"peak RSS rank {r}" for r in range(args.devices))
    print(f"\n| batches | a rank's batch | trained tokens/s | x padded | padding share | positions a step | step | {ranks} |")
    print("| --- | --- | --- | --- | --- | --- | --- |" + " --- |" * args.devices)
    for mode, row in summary["rows"].items():
        batch = f"{args.pack_batch_size} packs of <= {args.max_length}" if mode == "packed" else f"{args.batch_size} rows"
        memory = " | ".join(f"{m / 1e6:.0f} MB" for m in row["peak_rss"])
        print(f"| {mode} | {batch} | {row['tokens_per_s']:.0f} | {row['x_padded']:.2f}x | {row['padding_share']:.1%} | "
              f"{row['positions_per_step']:.0f} | {row['step_s']:.3f} s | {memory} |")  # fmt: skip


if __name__ == "__main__":
    main(parse_args())
