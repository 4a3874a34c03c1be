"""Generation under zero3's inference residency, against the peers, in one run.

Question: How fast does zero3 generate under an inference memory budget, against DDP, DeepSpeed and accelerate?

    python examples/benchmarks/benchmark_inference.py                  # ~20 minutes on 2 CPU cores
    python examples/benchmarks/benchmark_inference.py --nvme-layers 0  # part 1 alone; --layers 0: part 2 alone
    python examples/benchmarks/benchmark_inference.py --runs 1 --new-tokens 8 --layers 2 --nvme-layers 2   # a quick look

Part 1, 2 ranks, a Llama-style Hugging Face model of 101M parameters (random init, fp32): greedy
generation with a KV cache (``generate(..., synced_gpus=True)`` in ``predict_step``), batch 8 per rank,
prompt 64, 64 new tokens. Rows: zero3 with ``inference_memory_budget`` at the model's size, at half of it
and at 0 (every call gathers every unit: what ZeRO-3 does without a plan), DDP (every rank holds the
whole model: the limit), and DeepSpeed ZeRO-3's engine where the ``deepspeed`` package is installed.
The first predict batch is the warm-up (and zero3's profile calls); the second is timed.

Part 2, one process, a model of 129M parameters (516 MB of fp32 weights) with its cold units on NVMe
(``offload_params="nvme"``): budgets of 25%, 50% and 75% of the weights stay resident, the rest is read
from the swap files for every forward call; at 100% every unit stays resident (read once per stage), which
is how fast the model computes on this machine with nothing streamed. Per row: tokens/s, the bytes read
from disk per generated token, the disk's own sequential read bandwidth measured right before each run (a
1 GB file read cold through the same calls, into a page-aligned buffer as zero3's, so with ``O_DIRECT``:
it drifts by up to 1.5x on this machine), the bound that
bandwidth sets (bandwidth / bytes per token), and the ratio of tokens/s to the bound of the run: the
lower of the disk's bound and the all-resident speed (a run that reads little from disk is held by its
compute, not by the disk). The peer row is Hugging Face accelerate's big-model inference with the same budget as
``max_memory`` and the rest in an ``offload_folder``; its bound is the disk's alone. Page cache: zero3 drops what it read from the swap
files after every read; for accelerate the offload folder is dropped from the page cache before every
forward call, so both read from the disk.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # this folder, and examples/ (gpt.py, data.py)

from processes import close_process_group, exit_note, peak_rss, read_result, run_worker  # noqa: E402

PART1 = ("zero3_full", "zero3_half", "zero3_zero", "ddp", "deepspeed")
PART2 = ("zero3_nvme_25", "zero3_nvme_50", "zero3_nvme_75", "zero3_nvme_100", "accelerate_25", "accelerate_50",
         "accelerate_75")  # fmt: skip
RESIDENT = "zero3_nvme_100"  # every unit resident: read from disk once per stage, the model's compute speed


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--layers", type=int, default=14, help="part 1: decoder layers (hidden 768); 0 skips part 1")
    p.add_argument("--nvme-layers", type=int, default=10, help="part 2: decoder layers (hidden 1024); 0 skips part 2")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--nvme-batch", type=int, default=1)
    p.add_argument("--nvme-new-tokens", type=int, default=16)
    p.add_argument("--nvme-path", default=tempfile.gettempdir())
    p.add_argument("--json", type=Path, default=Path("benchmark_inference.json"))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def model_config(layers: int, hidden: int, vocab: int = 8192):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 256 * 256,
                       num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=4,
                       max_position_embeddings=512, tie_word_embeddings=False)  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# the parent


def main(args: argparse.Namespace) -> dict:
    rows: dict[str, list] = {}
    parts = ([PART1] if args.layers else []) + ([PART2] if args.nvme_layers else [])
    disks: list[float] = []  # the disk's read bandwidth, measured right before each part 2 run (it drifts)
    for part in parts:
        for run in range(args.runs):
            for name in part[run % len(part) :] + part[: run % len(part)]:
                disk = measure_disk(Path(args.nvme_path))["read_GBps"] if part is PART2 else None
                outcome = launch(name, args)
                if disk is not None:
                    disks.append(disk)
                    if isinstance(outcome, dict):
                        outcome["disk_GBps"] = disk
                print(f"run {run + 1}/{args.runs} {name}: {outcome if isinstance(outcome, str) else _short(outcome)}",
                      flush=True)  # fmt: skip
                rows.setdefault(name, []).append(outcome)
    disk = {"read_GBps": statistics.median(disks), "min_GBps": min(disks), "max_GBps": max(disks)} if disks else None
    summary = summarize(rows, disk, args)
    print()
    print(table(summary, args))
    args.json.write_text(json.dumps(summary, indent=2))
    print(f"\nwritten to {args.json}")
    return summary


def _short(outcome: dict) -> str:
    return f"{outcome['tokens_per_s']:.1f} tokens/s{exit_note(outcome)}"


def launch(name: str, args) -> dict | str:
    if name == "deepspeed":
        if not _importable("deepspeed"):
            return "skipped: the deepspeed package is not installed (pip install deepspeed)"
    if name.startswith("accelerate") and not _importable("accelerate"):
        return "skipped: the accelerate package is not installed (pip install accelerate)"
    forwarded = ["--layers", str(args.layers), "--nvme-layers", str(args.nvme_layers), "--batch", str(args.batch),
                 "--prompt", str(args.prompt), "--new-tokens", str(args.new_tokens), "--nvme-batch",
                 str(args.nvme_batch), "--nvme-new-tokens", str(args.nvme_new_tokens), "--nvme-path", args.nvme_path]  # fmt: skip
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    with tempfile.TemporaryDirectory() as tmp:
        worker = [str(HERE / "benchmark_inference.py"), *forwarded, "--worker", name, "--out", tmp]
        code, output = run_worker(worker, env, timeout=7200, ranks=2 if name == "deepspeed" else 0)
        return read_result(Path(tmp) / "result.json", code, output, exit_may_fail=name == "deepspeed")


def summarize(rows: dict[str, list], disk: dict | None, args) -> dict:
    out: dict = {"disk": disk, "rows": {}}
    for name, runs in rows.items():
        good = [r for r in runs if isinstance(r, dict)]
        if not good:
            out["rows"][name] = {"skipped": runs[0]}
            continue
        row = {key: statistics.median(r[key] for r in good) for key in ("tokens_per_s", "bytes_read_per_token")
               if all(r.get(key) is not None for r in good)}  # fmt: skip
        if all(r.get("bytes_read_per_token") and r.get("disk_GBps") for r in good):
            # each run against the disk as measured just before it
            row["disk_bound_tokens_per_s"] = statistics.median(map(_disk_bound, good))
        row["tokens"] = good[0]["tokens"]
        row["budget_bytes"] = good[0].get("budget_bytes")
        row["model_bytes"] = good[0]["model_bytes"]
        row["peak_rss"] = max(r["peak_rss"] for r in good)
        out["rows"][name] = row
    table_rows = out["rows"]
    ddp = table_rows.get("ddp", {}).get("tokens_per_s")
    zero = table_rows.get("zero3_zero", {}).get("tokens_per_s")
    resident = table_rows.get(RESIDENT, {}).get("tokens_per_s")
    for name, row in table_rows.items():
        if "tokens_per_s" not in row:
            continue
        if "disk_bound_tokens_per_s" in row and name != RESIDENT:
            # the run's bound: the disk's, or the speed with nothing streamed where that is lower (zero3 rows)
            own = [r for r in rows[name] if isinstance(r, dict)]
            bounds = [_disk_bound(r) for r in own]
            if resident and name.startswith("zero3_nvme"):
                bounds = [min(bound, resident) for bound in bounds]
            row["bound_tokens_per_s"] = statistics.median(bounds)
            row["x_bound"] = statistics.median(r["tokens_per_s"] / bound for r, bound in zip(own, bounds))
        if name in PART1 and ddp:
            row["x_ddp"] = row["tokens_per_s"] / ddp
        if name in PART1 and zero:
            row["x_zero_budget"] = row["tokens_per_s"] / zero
        peer = table_rows.get(name.replace("zero3_nvme", "accelerate"), {}).get("tokens_per_s")
        if name.startswith("zero3_nvme") and peer:
            row["x_accelerate"] = row["tokens_per_s"] / peer
    out["config"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    return out


def _disk_bound(run: dict) -> float:
    """The tokens/s the disk allows one run: its bandwidth, measured right before it, over its bytes per token."""
    return run["disk_GBps"] * 1e9 / run["bytes_read_per_token"]


def _body(names: tuple, rows: dict, cells, width: int) -> list[tuple]:
    """One table line per row that ran (``cells(name, row)``); a skipped row shows the first line of its reason."""
    body = []
    for name in names:
        row = rows.get(name)
        if row is None:
            continue
        if "skipped" in row:
            body.append((name, row["skipped"].splitlines()[0][:80], *[""] * (width - 2)))
        else:
            body.append(cells(name, row))
    return body


def table(summary: dict, args) -> str:
    rows = summary["rows"]
    lines: list[str] = []
    if any(name in rows for name in PART1):
        lines += _part1_table(rows, args)
    if any(name in rows for name in PART2):
        lines += [""] if lines else []
        lines += _part2_table(rows, summary["disk"], args)
    return "\n".join(lines)


def _part1_table(rows: dict, args) -> list[str]:
    lines = [f"Part 1: 2 CPU ranks, Llama-style model, greedy generation with a KV cache, batch {args.batch} per rank, "
             f"prompt {args.prompt}, {args.new_tokens} new tokens; median of {args.runs} runs"]  # fmt: skip
    head = ("row", "budget MiB", "tokens/s", "x DDP", "x budget 0", "peak RSS MiB")

    def part1(name: str, row: dict) -> tuple:
        budget = row.get("budget_bytes")
        return (name, "" if budget is None else f"{budget / 2**20:.0f}", f"{row['tokens_per_s']:.1f}",
                f"{row.get('x_ddp', float('nan')):.2f}", f"{row.get('x_zero_budget', float('nan')):.2f}",
                f"{row['peak_rss'] / 2**20:.0f}")  # fmt: skip

    return lines + _grid(head, _body(PART1, rows, part1, len(head)))


def _part2_table(rows: dict, disk: dict, args) -> list[str]:
    lines = [f"Part 2: one process, cold units on NVMe, batch {args.nvme_batch}, {args.nvme_new_tokens} new tokens; "
             f"the disk reads {disk['read_GBps']:.2f} GB/s cold (median of {args.runs * len(PART2)} "
             f"measurements, one right before each run: {disk['min_GBps']:.2f}-{disk['max_GBps']:.2f}); "
             f"bound: the disk's bound of each run (measured right before it), or {RESIDENT}'s speed where lower"]  # fmt: skip
    head = ("row", "budget", "tokens/s", "MB read/token", "disk bound tokens/s", "bound tokens/s", "x bound",
            "x accelerate", "peak RSS MiB")  # fmt: skip

    def part2(name: str, row: dict) -> tuple:
        per_token = row.get("bytes_read_per_token")
        return (name, name.rsplit("_", 1)[1] + "%", f"{row['tokens_per_s']:.2f}",
                "" if per_token is None else f"{per_token / 1e6:.1f}",
                _figure(row, "disk_bound_tokens_per_s"), _figure(row, "bound_tokens_per_s"),
                _figure(row, "x_bound"), _figure(row, "x_accelerate"), f"{row['peak_rss'] / 2**20:.0f}")  # fmt: skip

    return lines + _grid(head, _body(PART2, rows, part2, len(head)))


def _figure(row: dict, key: str) -> str:
    return f"{row[key]:.2f}" if key in row else "-"


def _grid(head: tuple, body: list) -> list[str]:
    lines = [head, *body]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = [" | ".join(cell.ljust(width) for cell, width in zip(line, widths)) for line in lines]
    out.insert(1, "-+-".join("-" * width for width in widths))
    return out


# ---------------------------------------------------------------------------------------------------
# the disk, measured the way the swap files are read


def measure_disk(folder: Path, nbytes: int = 1 << 30) -> dict:
    import torch

    from lightning_zero3.engine.memory.buffers import host_buffer
    from lightning_zero3.engine.offload.aio import AsyncFileIO
    from lightning_zero3.engine.offload.swapdir import SwapDirectory
    from lightning_zero3.engine.offload.tiers import IO_THREADS

    swap = SwapDirectory(str(folder), rank=0)
    try:
        file = swap.create("disk-probe", nbytes)
        io = AsyncFileIO(400_000_000, threads=IO_THREADS)
        # a buffer like the ones zero3 reads its swap files into (page-aligned, so read with O_DIRECT):
        # torch.ones' heap memory sits 64 bytes past a page, and its reads went through the page cache
        buffer = host_buffer(nbytes // 4, torch.float32).fill_(1.0)
        io.wait(io.write(file, buffer))
        os.fsync(file.fd)
        os.posix_fadvise(file.fd, 0, nbytes, os.POSIX_FADV_DONTNEED)
        pieces = 16  # the same request sizes as units of 64 MB, several in flight
        chunk = buffer.numel() // pieces
        start = time.perf_counter()
        futures = [io.read(file, buffer[i * chunk : (i + 1) * chunk], i * chunk * 4) for i in range(pieces)]
        for future in futures:
            io.wait(future)
        seconds = time.perf_counter() - start
        io.close()
        return {"read_GBps": nbytes / seconds / 1e9, "bytes": nbytes}
    finally:
        swap.remove()


# ---------------------------------------------------------------------------------------------------
# the workers


def prompts(count: int, length: int, vocab: int, seed: int):
    import torch

    return torch.randint(1, vocab, (count, length), generator=torch.Generator().manual_seed(seed))


def lightning_worker(name: str, args) -> None:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader
    from transformers import LlamaForCausalLM

    import lightning_zero3

    part2 = name.startswith("zero3_nvme")
    cfg = model_config(args.nvme_layers, 1024) if part2 else model_config(args.layers, 768)
    batch, new_tokens = (args.nvme_batch, args.nvme_new_tokens) if part2 else (args.batch, args.new_tokens)
    devices = 1 if part2 else 2
    model_bytes = None

    class Generator(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = None
            self.times: list[float] = []
            self.read_bytes: list[int] = []

        def configure_model(self) -> None:
            if self.model is None:
                torch.manual_seed(0)
                self.model = LlamaForCausalLM(cfg)  # on the meta device under zero3: built into the shards

        def init_weights(self, module) -> None:
            self.model._init_weights(module)

        def predict_step(self, ids, batch_idx):
            return self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                                       synced_gpus=devices > 1)  # fmt: skip

    class Timer(pl.Callback):
        """Each predict batch, whole: the root's gather at its start is part of it."""

        def _io(self):
            engine = lightning_zero3.engine_of(module)
            return engine.offload.io if engine is not None and engine.offload is not None else None

        def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
            io = self._io()
            self.read0 = io.stats.read_bytes if io is not None else 0
            self.start = time.perf_counter()

        def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
            module.times.append(time.perf_counter() - self.start)
            io = self._io()
            module.read_bytes.append((io.stats.read_bytes if io is not None else 0) - self.read0)

    module = Generator()
    if name == "ddp":
        module.configure_model()
        strategy = "ddp"
    else:
        with torch.device("meta"):
            model_bytes = sum(p.numel() for p in LlamaForCausalLM(cfg).parameters()) * 4
        fraction = {"full": 1.0, "half": 0.5, "zero": 0.0}.get(name.split("_")[-1]) if not part2 else int(name.split("_")[-1]) / 100
        knobs = {"inference_memory_budget": int(model_bytes * fraction), "persistence_threshold": 100_000}
        if part2:
            knobs.update(offload_optimizer="nvme", offload_params="nvme", nvme_path=args.nvme_path)
        strategy = lightning_zero3.Zero3Strategy(**knobs)
    data = prompts(2 * devices * batch, args.prompt, cfg.vocab_size, seed=1)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, callbacks=[Timer()])  # fmt: skip
    trainer.predict(module, DataLoader(data, batch_size=batch))
    timed = module.times[-1]  # the first batch warms up (and is zero3's profile)
    tokens = devices * batch * new_tokens
    figures = torch.tensor([timed, peak_rss()], dtype=torch.float64)
    figures = trainer.strategy.reduce(figures, reduce_op="max")
    if trainer.is_global_zero:
        (args.out / "result.json").write_text(json.dumps({
            "tokens_per_s": tokens / float(figures[0]), "tokens": tokens, "peak_rss": int(figures[1]),
            "model_bytes": model_bytes or sum(p.numel() * 4 for p in module.model.parameters()),
            "budget_bytes": knobs["inference_memory_budget"] if name != "ddp" else None,
            "bytes_read_per_token": module.read_bytes[-1] / (batch * new_tokens) if part2 else None,
        }))  # fmt: skip
    close_process_group()


def accelerate_worker(name: str, args) -> None:
    import torch
    from accelerate import dispatch_model, infer_auto_device_map
    from transformers import LlamaForCausalLM

    cfg = model_config(args.nvme_layers, 1024)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    budget = int(model_bytes * int(name.split("_")[-1]) / 100)
    device_map = infer_auto_device_map(model, max_memory={"cpu": budget, "disk": 10 * model_bytes},
                                       no_split_module_classes=["LlamaDecoderLayer"])  # fmt: skip
    if list(device_map) == [""]:  # a model too small to split is mapped whole, and dispatch_model then writes
        device_map = {name: device_map[""] for name, _ in model.named_children()}  # no offload index: name its parts
    folder = Path(tempfile.mkdtemp(dir=args.nvme_path, prefix="accelerate-offload-"))
    try:
        model = dispatch_model(model, device_map=device_map, offload_dir=str(folder))

        def drop_cache(*_args, **_kwargs) -> None:  # every forward call reads the disk, as zero3's does
            for file in folder.rglob("*"):
                if file.is_file():
                    fd = os.open(file, os.O_RDONLY)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    os.close(fd)

        model.register_forward_pre_hook(drop_cache)
        on_disk = sum(file.stat().st_size for file in folder.rglob("*") if file.is_file())
        ids = prompts(2 * args.nvme_batch, args.prompt, cfg.vocab_size, seed=1)
        times = []
        with torch.no_grad():
            for batch in ids.split(args.nvme_batch):
                start = time.perf_counter()
                model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=args.nvme_new_tokens,
                               min_new_tokens=args.nvme_new_tokens, do_sample=False, pad_token_id=0)  # fmt: skip
                times.append(time.perf_counter() - start)
        tokens = args.nvme_batch * args.nvme_new_tokens
        calls_per_token = 1 / args.nvme_batch  # one forward call per new token of the batch
        (args.out / "result.json").write_text(json.dumps({
            "tokens_per_s": tokens / times[-1], "tokens": tokens, "peak_rss": peak_rss(), "model_bytes": model_bytes,
            "budget_bytes": budget, "bytes_read_per_token": on_disk * calls_per_token,
        }))  # fmt: skip
    finally:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


def deepspeed_worker(args) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = model_config(args.layers, 768)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    config = {"train_micro_batch_size_per_gpu": args.batch, "zero_optimization": {"stage": 3}}
    engine = deepspeed.initialize(model=model, config=config)[0]
    engine.module.eval()
    ids = prompts(2 * world * args.batch, args.prompt, cfg.vocab_size, seed=1)[rank::world]
    times = []
    with torch.no_grad():
        for batch in ids.split(args.batch):
            start = time.perf_counter()
            engine.module.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=args.new_tokens,
                                   min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0, synced_gpus=True)  # fmt: skip
            times.append(time.perf_counter() - start)
    figures = torch.tensor([times[-1], peak_rss()], dtype=torch.float64)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    if rank == 0:
        tokens = world * args.batch * args.new_tokens
        (args.out / "result.json").write_text(json.dumps({
            "tokens_per_s": tokens / float(figures[0]), "tokens": tokens, "peak_rss": int(figures[1]),
            "model_bytes": sum(p.ds_numel * 4 for p in engine.module.parameters()), "budget_bytes": None,
            "bytes_read_per_token": None,
        }))  # fmt: skip
    close_process_group()  # deepspeed.init_distributed leaves it open, as Lightning's DDP does


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.worker == "deepspeed":
        deepspeed_worker(arguments)
    elif arguments.worker and arguments.worker.startswith("accelerate"):
        accelerate_worker(arguments.worker, arguments)
    elif arguments.worker:
        lightning_worker(arguments.worker, arguments)
    else:
        main(arguments)
