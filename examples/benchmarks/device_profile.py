"""Where a training step's time goes on one GPU: how long the device computed and how long it sat idle
waiting for the host, how often the host waited for the device, and which kernels took the time.

Question: Where does a GPU training step's time go: device compute, idle waiting for the host, which kernels?

    python examples/benchmarks/device_profile.py --strategy zero3 --n-layer 12 --n-embd 768 --n-head 12 \
        --block-size 512 --batch-size 16 --precision bf16-mixed     # prints one row, --json for the figures

One process, one device (``Trainer(devices=1)``): ``--strategy`` is zero3, ddp or single (plain Lightning,
``strategy="auto"``); the model options are ``examples/benchmarks/benchmark.py``'s. After ``--warmup`` steps,
``torch.profiler`` records ``--steps`` more, the host waiting for the device before and after them, and:

- ``busy``: the union of the device's kernel, copy and fill intervals per step; ``idle`` = wall - busy.
  A step whose idle time is large is bound by the host (Python, launches, or a wait for the device);
  one whose busy time is larger than another strategy's does more device work.
- ``syncs``: calls per step of the CUDA runtime's ``*Synchronize`` functions, each a host wait for the
  device (a ``.item()``, a barrier, an event waited on).
- ``kernels``: device operations per step, and the five that took the longest in total.

On a CPU (``--accelerator cpu``, a dry run of this script) there are no device events: busy, idle and
kernels are reported as missing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Optional

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # this folder, and examples/ (gpt.py, data.py)

STRATEGIES = ("zero3", "ddp", "single")
TOP_KERNELS = 5


def busy_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals (in seconds, as given)."""
    total, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def summarize(events: Iterable[Any], wall_s: float, steps: int) -> dict:
    """Per-step figures from profiler events (``name``, ``device_type``, ``time_range`` in microseconds)."""
    from torch.autograd import DeviceType

    device, syncs = [], 0
    for event in events:
        if event.device_type == DeviceType.CUDA:
            device.append(event)
        elif "Synchronize" in event.name:
            syncs += 1
    by_name: dict[str, float] = defaultdict(float)
    for event in device:
        by_name[event.name] += (event.time_range.end - event.time_range.start) / 1e6
    busy = busy_seconds((e.time_range.start / 1e6, e.time_range.end / 1e6) for e in device) if device else None
    top = sorted(by_name.items(), key=lambda item: -item[1])[:TOP_KERNELS]
    return {
        "wall_s": wall_s / steps,
        "busy_s": None if busy is None else busy / steps,
        "idle_s": None if busy is None else max(0.0, wall_s - busy) / steps,
        "syncs": syncs / steps,
        "kernels": len(device) / steps,
        "top": [(name, seconds / steps) for name, seconds in top],
    }


def describe(strategy: str, figures: dict) -> str:
    """One line: wall, busy and idle per step, syncs, kernels, and the costliest kernels."""
    ms = lambda s: "n/a" if s is None else f"{s * 1e3:.1f} ms"  # noqa: E731
    top = ", ".join(f"{name[:40]} {seconds * 1e3:.1f} ms" for name, seconds in figures["top"]) or "none seen"
    return (f"{strategy}: step {ms(figures['wall_s'])}, device busy {ms(figures['busy_s'])}, idle "
            f"{ms(figures['idle_s'])}; {figures['syncs']:.1f} host syncs and {figures['kernels']:.0f} device "
            f"operations per step; longest: {top}")  # fmt: skip


def profile(strategy: str, args: argparse.Namespace) -> dict:
    """Train ``args.warmup + args.steps`` steps, profiling the last ``args.steps``; the figures per step."""
    import lightning.pytorch as pl
    import torch
    from benchmark import dataset, model_config
    from gpt import GPTModule
    from torch.profiler import ProfilerActivity
    from torch.utils.data import DataLoader

    import lightning_zero3

    cuda = args.accelerator == "cuda"
    first, last = args.warmup, args.warmup + args.steps - 1  # the profiled steps' indices
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]

    def finish_device_work() -> None:
        if cuda:
            torch.cuda.synchronize()

    class Window(pl.Callback):
        """The profiler on from the first step after the warm-up until the last step's end."""

        def __init__(self) -> None:
            self.profiler: Optional[torch.profiler.profile] = None
            self.started = self.wall = 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == first:
                finish_device_work()
                self.profiler = torch.profiler.profile(activities=activities)
                self.profiler.__enter__()
                self.started = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == last:
                finish_device_work()
                self.wall = time.perf_counter() - self.started
                self.profiler.__exit__(None, None, None)

    pl.seed_everything(0)
    steps = args.steps
    args.steps = last + 1  # ``dataset`` sizes the data by it
    chosen: Any = {"zero3": lightning_zero3.Zero3Strategy(), "ddp": "ddp", "single": "auto"}[strategy]
    window = Window()
    trainer = pl.Trainer(strategy=chosen, accelerator=args.accelerator, devices=1, max_steps=args.steps,
                         precision=args.precision, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[window])  # fmt: skip
    with torch.device("cuda") if cuda else contextlib.nullcontext():  # built on the GPU, as in benchmark.py
        module = GPTModule(model_config(args))
    trainer.fit(module, DataLoader(dataset(args), batch_size=args.batch_size))
    assert window.wall > 0, "the profiled steps never ended"
    return summarize(window.profiler.events(), window.wall, steps)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    from benchmark import parse_args as benchmark_args

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategy", choices=STRATEGIES, required=True)
    p.add_argument("--json", type=Path, help="write the figures here")
    own, rest = p.parse_known_args(argv)
    args = benchmark_args([*rest, "--devices", "1"])  # the model, batch, steps, precision and accelerator options
    args.strategy, args.json = own.strategy, own.json
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    figures = profile(args.strategy, args)
    print(describe(args.strategy, figures))
    if args.json:
        args.json.write_text(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
