"""Whole-run peak memory of each rank, for zero3 and its peers, as a user runs them.

Question: What is each rank's peak memory over a whole run, and how large a model fits in a given host memory under offload?

    python examples/benchmarks/benchmark_memory.py                 # ~25 minutes on 2 CPU cores
    python examples/benchmarks/benchmark_memory.py --runs 1 --steps 2 --n-layer 2 --capacity-layers 2   # a quick look

Part 1, 2 ranks, a GPT of 113M parameters (16 layers x 768): every strategy runs, in one process per rank,
what a user's script does: ``fit`` with ``gradient_clip_val=1.0`` and one checkpoint saved by
``ModelCheckpoint``, then ``validate``, ``trainer.save_checkpoint`` and ``predict``. Each rank reads its
whole-process peak resident memory (the kernel's ``VmHWM``) when everything has finished, just before it
exits, and the model-state bytes it held at the optimizer step (parameters + gradients + optimizer
state). Strategies: DDP, torch FSDP2 (Lightning's ``ModelParallelStrategy``, ``fully_shard`` per block),
``zero3`` (model built in ``configure_model``: sharded initialisation), ``zero3_offload`` and
``zero3_offload_nvme``. No allocator variable is set: the environment a user has.

Part 2, 1 rank, a GPT of 340M parameters (48 layers x 768; 5.4 GB of states at 16 bytes a parameter):
``zero3_offload_nvme`` (``offload_buffer_count=2``: two units' states in host memory at once) against
``zero3`` without offload, the same run, clipping and checkpoint included: the ratio of the states to
the offloaded run's peak, and its losses against the run without offload.

Runs alternate between strategies; the table gives the median over runs.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # this folder, and examples/ (gpt.py, data.py)

from processes import close_process_group, peak_rss, run_worker  # noqa: E402

STRATEGIES = ("ddp", "fsdp2", "zero3", "zero3_offload", "zero3_offload_nvme")
CAPACITY = ("zero3", "zero3_offload_nvme")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--n-layer", type=int, default=16)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--capacity-layers", type=int, default=48, help="part 2: layers of 768 (0: skip part 2)")
    p.add_argument("--nvme-path", default=tempfile.gettempdir())
    p.add_argument("--json", type=Path, default=Path("benchmark_memory.json"))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--devices", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------------
# the parent


def main(args: argparse.Namespace) -> dict:
    parts = {"2 ranks": (args.strategies.split(","), 2, args.n_layer, args.n_embd)}
    if args.capacity_layers:
        parts["1 rank"] = (list(CAPACITY), 1, args.capacity_layers, 768)
    summary: dict = {}
    for part, (strategies, devices, layers, width) in parts.items():
        results: dict[str, list] = {s: [] for s in strategies}
        for run in range(args.runs):
            order = strategies[run % len(strategies) :] + strategies[: run % len(strategies)]
            for strategy in order:
                outcome = launch(strategy, devices, layers, width, args)
                print(f"{part}, run {run + 1}/{args.runs}, {strategy}: {describe(outcome)}", flush=True)
                if not isinstance(outcome, str):
                    results[strategy].append(outcome)
        summary[part] = summarize(results, devices, layers, width)
    print()
    print(table(summary, args))
    args.json.write_text(json.dumps(summary, indent=2))
    print(f"\nwritten to {args.json}")
    return summary


def launch(strategy: str, devices: int, layers: int, width: int, args) -> list | str:
    with tempfile.TemporaryDirectory() as tmp:
        worker = [str(HERE / "benchmark_memory.py"), "--worker", strategy, "--devices", str(devices),
                  "--n-layer", str(layers), "--n-embd", str(width), "--steps", str(args.steps),
                  "--nvme-path", args.nvme_path, "--out", tmp]  # fmt: skip
        code, output = run_worker(worker, {**os.environ, "PYTHONWARNINGS": "ignore"}, timeout=7200)
        ranks = sorted(Path(tmp).glob("rank*.json"))
        if code != 0 or len(ranks) != devices:
            return f"failed (exit {code}): {output[-1500:]}"
        return [json.loads(r.read_text()) for r in ranks]


def describe(outcome) -> str:
    if isinstance(outcome, str):
        return outcome
    return "peak RSS per rank " + ", ".join(f"{r['peak_rss'] / 2**20:.0f} MiB" for r in outcome)


def summarize(results: dict[str, list], devices: int, layers: int, width: int) -> dict:
    rows = {}
    for strategy, runs in results.items():
        if not runs:
            continue
        rows[strategy] = {
            "peak_rss_per_rank": [statistics.median(run[r]["peak_rss"] for run in runs) for r in range(devices)],
            "model_state_bytes": statistics.median(max(r["model_state"] for r in run) for run in runs),
            "params": runs[0][0]["params"],
            "losses": runs[0][0]["losses"],
            "val_loss": runs[0][0]["val_loss"],
            "runs": len(runs),
        }
    for row in rows.values():  # first, so that the reference has it whatever the order of --strategies
        row["worst_peak"] = max(row["peak_rss_per_rank"])
    reference = rows.get("ddp") or rows.get("zero3")
    for name, row in rows.items():
        if reference is not None:
            row["peak_x_reference"] = row["worst_peak"] / reference["worst_peak"]
        row["states_x_peak"] = 16 * row["params"] / devices / row["worst_peak"]
        if name.startswith("zero3_offload") and "zero3" in rows:
            row["loss_rel_diff_vs_zero3"] = max(
                abs(a - b) / abs(b) for a, b in zip(row["losses"], rows["zero3"]["losses"])
            )
    return {"devices": devices, "layers": layers, "width": width, "reference": "ddp" if "ddp" in rows else "zero3",
            "rows": rows}  # fmt: skip


def table(summary: dict, args) -> str:
    out = []
    for part, block in summary.items():
        params = next(iter(block["rows"].values()))["params"] if block["rows"] else 0
        reference = block["reference"]
        head = ("strategy", *[f"peak RSS rank {r} MiB" for r in range(block["devices"])],
                "model states/rank MiB", f"peak x {reference}", "states / peak", "losses vs zero3")  # fmt: skip
        lines = [head]
        for name, row in block["rows"].items():
            diff = row.get("loss_rel_diff_vs_zero3")
            lines.append((
                name,
                *[f"{v / 2**20:.0f}" for v in row["peak_rss_per_rank"]],
                f"{row['model_state_bytes'] / 2**20:.0f}",
                f"{row.get('peak_x_reference', float('nan')):.2f}",
                f"{row['states_x_peak']:.2f}x",
                "" if diff is None else f"{diff:.1e}",
            ))  # fmt: skip
        widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
        text = [" | ".join(cell.ljust(width) for cell, width in zip(line, widths)) for line in lines]
        text.insert(1, "-+-".join("-" * width for width in widths))
        out.append(
            f"{part}: GPT of {params / 1e6:.1f}M parameters ({block['layers']} layers x {block['width']}), fit "
            f"({args.steps} steps, gradient_clip_val=1.0, one ModelCheckpoint save) + validate + save_checkpoint + "
            f"predict; peak = VmHWM read at exit; median of {args.runs} runs"
        )
        out.extend(text)
        out.append("")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------
# the workers: one strategy, one process per rank (Lightning's launcher starts the others)


def worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    from gpt import GPTConfig, GPTModule, apply_fsdp2, count_parameters, random_tokens
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.utils.data import DataLoader

    import lightning_zero3

    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=args.n_layer, n_head=args.n_embd // 64, n_embd=args.n_embd,
                    tie_embeddings=True)  # fmt: skip
    zero3 = args.worker.startswith("zero3")

    class MemoryGPT(GPTModule):
        def configure_model(self):
            super().configure_model()
            if isinstance(self.trainer.strategy, ModelParallelStrategy) and not getattr(self, "_fully_sharded", False):
                self._fully_sharded = True  # configure_model runs again for validate / predict: once per model
                apply_fsdp2(self.model, self.device_mesh["data_parallel"])

    class Probe(pl.Callback):
        def __init__(self) -> None:
            self.losses, self.model_state = [], 0

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            engine = getattr(trainer.strategy, "engine", None)
            if engine is not None:
                r = engine.memory_report()
                self.model_state = r["param_shards"] + r["persistent_params"] + r["grad_shards"] + r["optimizer_state"]
                self.model_state += r["offload_host"]  # host tier: masters, gradients and staging
            else:
                params = list(pl_module.parameters())
                self.model_state = _bytes(params) + _bytes(p.grad for p in params) + _bytes(
                    v for s in optimizer.state.values() for v in s.values() if hasattr(v, "numel")
                )

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses.append(float(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")))

    pl.seed_everything(0)
    model = MemoryGPT(cfg, sharded_init=zero3)
    nvme = {"nvme_path": args.nvme_path} if args.worker == "zero3_offload_nvme" else {}
    if nvme and args.devices == 1:
        nvme["offload_buffer_count"] = 2  # part 2: the fewest units in host memory the setting allows
    strategy = {
        "ddp": lambda: "ddp",
        "fsdp2": lambda: ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1),
    }.get(args.worker, lambda: lightning_zero3.Zero3Strategy(**_registered(args.worker), **nvme))()
    data = random_tokens(args.steps * args.devices, cfg.block_size, cfg.vocab_size, seed=1)
    loader = DataLoader(data, batch_size=1)
    probe = Probe()
    checkpoints = Path(args.out) / "checkpoints"
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=args.devices, max_steps=args.steps, gradient_clip_val=1.0,
        logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=2,
        num_sanity_val_steps=0, callbacks=[probe, ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=args.steps // 2,
                                                                  save_top_k=1)],
    )  # fmt: skip
    trainer.fit(model, loader)
    val_loss = trainer.validate(model, loader, verbose=False)[0]["val_loss"]
    trainer.save_checkpoint(checkpoints / "after_fit.ckpt")
    trainer.predict(model, DataLoader(data, batch_size=1))
    rank = trainer.global_rank
    params = count_parameters(model)  # whole parameters (DTensors and released parameters report their full size)
    result = {"rank": rank, "params": params, "losses": probe.losses, "val_loss": val_loss,
              "model_state": probe.model_state}  # fmt: skip

    def write_at_exit() -> None:  # the whole run's peak, read as late as this process can
        result["peak_rss"] = peak_rss()
        (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(result))

    atexit.register(write_at_exit)
    close_process_group()


def _registered(name: str) -> dict:
    """The settings a registered name stands for (``"zero3_offload"`` -> its offload knobs)."""
    return {
        "zero3": {},
        "zero3_offload": {"offload_optimizer": "cpu", "offload_params": "cpu"},
        "zero3_offload_nvme": {"offload_optimizer": "nvme", "offload_params": "nvme"},
    }[name]


def _bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if t is not None:
            local = t.to_local() if hasattr(t, "to_local") else t
            total += local.numel() * local.element_size()
    return total


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.worker:
        worker(arguments)
    else:
        main(arguments)
