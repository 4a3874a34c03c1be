"""Where a step's time goes by phase (forward, backward, optimizer step), zero3 beside DDP, with how often the
compute thread was preempted in each: a table.

Question: How does a step's time split into forward, backward and optimizer step, zero3 beside DDP?

    python examples/benchmarks/step_phases.py                         # the benchmark GPT (8 x 448), 2 CPU ranks, 3 runs each
    python examples/benchmarks/step_phases.py --runs 3 --strategies zero3,ddp,fsdp2

Each run trains the GPT of ``examples/benchmarks/benchmark.py`` (its options and defaults) through a Lightning
``Trainer``, the strategies in turn; rank 0 marks Lightning's hooks around each phase of every step after
the warm-up (``on_train_batch_start``, ``on_before_backward``, ``on_after_backward``,
``on_before_optimizer_step``, ``on_train_batch_end``) and reads, at each mark, the wall clock, the CPU time
of its own thread (the one that computes) and that thread's involuntary context switches (``getrusage``:
the times the kernel took the core away from it for another thread, such as a collective's helper
thread or the other rank's). The table gives each phase's median over the steps, then the median over
the runs. Linux only (per-thread ``getrusage``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # this folder, and examples/ (gpt.py, data.py)

PHASES = (("forward", "start", "backward"), ("backward", "backward", "after backward"),
          ("optimizer", "optimizer", "end"))  # fmt: skip
FIGURES = ("wall ms", "thread CPU ms", "preempted")
STRATEGIES = ("zero3", "ddp", "fsdp2")


def worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    from benchmark import dataset, model_config, zero3_knobs
    from gpt import GPTModule, apply_fsdp2
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.utils.data import DataLoader

    import lightning_zero3  # noqa: F401  (registers "zero3")

    class Phases(pl.Callback):
        def __init__(self) -> None:
            self.marks: dict[str, tuple[float, float, int]] = {}
            self.steps: list[dict[str, list[float]]] = []

        def _mark(self, name: str) -> None:
            usage = resource.getrusage(resource.RUSAGE_THREAD)
            self.marks[name] = (time.perf_counter(), time.thread_time(), usage.ru_nivcsw)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self._mark("start")

        def on_before_backward(self, trainer, pl_module, loss):
            self._mark("backward")

        def on_after_backward(self, trainer, pl_module):
            self._mark("after backward")

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self._mark("optimizer")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self._mark("end")
            if batch_idx >= args.warmup:
                m = self.marks
                self.steps.append({phase: [1e3 * (m[b][0] - m[a][0]), 1e3 * (m[b][1] - m[a][1]), m[b][2] - m[a][2]]
                                   for phase, a, b in PHASES})  # fmt: skip

    class Model(GPTModule):
        def configure_model(self):
            if isinstance(self.trainer.strategy, ModelParallelStrategy):  # FSDP2: one unit per block
                apply_fsdp2(self.model, self.device_mesh["data_parallel"])

    if args.worker == "zero3":
        strategy = lightning_zero3.Zero3Strategy(**zero3_knobs(args.zero3))
    elif args.worker == "fsdp2":
        strategy = ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1)
    else:
        strategy = "ddp"
    pl.seed_everything(0)
    phases = Phases()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=args.devices, max_steps=args.steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[phases])  # fmt: skip
    trainer.fit(Model(model_config(args)), DataLoader(dataset(args), batch_size=args.batch_size))
    if trainer.is_global_zero:
        medians = {phase: [statistics.median(step[phase][i] for step in phases.steps) for i in range(len(FIGURES))]
                   for phase, _, _ in PHASES}  # fmt: skip
        Path(args.result).write_text(json.dumps(medians))


def run(strategy: str, argv: list[str]) -> dict:
    """One run of ``strategy`` in processes of its own; a failed run ends the command with the worker's
    last lines (the benchmark's launch and reading of results, examples/benchmarks/processes.py)."""
    from processes import read_result, run_worker

    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        worker_argv = [__file__, *argv, "--worker", strategy, "--result", str(result)]
        code, output = run_worker(worker_argv, {**os.environ, "PYTHONWARNINGS": "ignore"}, timeout=3600)
        outcome = read_result(result, code, output)
    if isinstance(outcome, str):
        raise SystemExit(f"step_phases.py: {strategy}: {outcome}")
    return outcome


def table(results: dict[str, list[dict]]) -> str:
    rows = ["strategy | phase     | wall ms | thread CPU ms | preempted",
            "---------+-----------+---------+---------------+----------"]  # fmt: skip
    for strategy, runs in results.items():
        for phase, _, _ in PHASES:
            wall, cpu, preempted = (statistics.median(r[phase][i] for r in runs) for i in range(len(FIGURES)))
            rows.append(f"{strategy:8} | {phase:9} | {wall:7.1f} | {cpu:13.1f} | {preempted:9.0f}")
    return "\n".join(rows)


def main(argv=None) -> dict:
    from benchmark import parse_args  # the benchmark's options and defaults: model shape, batch, steps, --zero3
    from host_facts import describe_host, host_facts

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.result is not None:  # a worker: one strategy, one run (Lightning's launcher starts the other ranks)
        worker(args)
        return {}
    strategies = (args.strategies or "zero3,ddp").split(",")
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise SystemExit(f"step_phases.py: --strategies {','.join(unknown)}: choose among {', '.join(STRATEGIES)}")
    results: dict[str, list[dict]] = {s: [] for s in strategies}
    for r in range(args.runs):  # in turn, as the benchmark does, so that drift of the host hits all alike
        for strategy in strategies[r % len(strategies):] + strategies[: r % len(strategies)]:
            results[strategy].append(run(strategy, argv))
            print(f"run {r + 1}/{args.runs} {strategy}: done", flush=True)
    print(table(results))
    print(f"\nrank 0, median over {args.steps - args.warmup} steps, then over {args.runs} runs")
    print(describe_host(host_facts()))
    return results


if __name__ == "__main__":
    main()
