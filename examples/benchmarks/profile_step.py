"""Where zero3's host time goes in a training step, per unit: a table from Python's own profiler.

Question: Where does zero3's own host (Python) time go in a training step, per unit?

    python examples/benchmarks/profile_step.py                    # the benchmark GPT (8 x 448), 2 CPU ranks
    python examples/benchmarks/profile_step.py --n-layer 32 --n-embd 64 --n-head 4   # tiny layers: the step is overhead
    python examples/benchmarks/profile_step.py --devices 1        # one process (see "One process" in docs/design.md)
    python examples/benchmarks/profile_step.py --zero3 prefetch_bucket_size=0 --steps 12   # the benchmark's options
    python examples/benchmarks/profile_step.py --top=15           # and the 15 functions that cost zero3 most

Each rank trains the GPT of ``examples/benchmarks/benchmark.py`` (its options and defaults) through a Lightning ``Trainer`` and runs ``cProfile``
over the steps after the warm-up. Every function's own time is charged to a part of zero3 by the file it
is written in (a C function, such as a tensor copy or a collective's wait, to the file that called it), so
the table says what each part costs per step and per unit, and how many Python calls it makes per unit:

- hooks: ``hooks.py``, ``runtime.py``, ``prefetch.py`` (the module hooks, unit state, the recorded order);
- agreement: ``agreement.py`` (ranks agree on each gather before it is issued);
- gather / release: ``flat_group.py``, ``gather.py``, ``gathers.py``, ``released.py`` (issuing gathers, marking parameters);
- buffers & ledger: ``buffers.py``, ``parking.py``, ``libc.py`` (buffers, the byte ledger, parked pages);
- reductions: ``reduction.py``, ``gradients.py`` (packing gradients, reduce-scatters, the shared order);
- collectives: ``communicator.py``, ``records.py``, less its waits (issuing, timing, bookkeeping);
- waiting: time spent in the waits of collectives (communication the compute did not hide);
- optimizer: ``optim.py``, ``optimizer_state.py`` and the rest of ``lightning_zero3``;
- not zero3: the model, autograd, the optimizer's own math, Lightning.

The profiler adds a cost per Python call, so a part's milliseconds are inflated by about its call
count times that cost (printed below the table); the call counts themselves are exact. The figures are
the mean of the ranks.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # this folder, and examples/ (gpt.py, data.py)

PARTS = {
    "hooks": ("hooks.py", "runtime.py", "prefetch.py"),
    "agreement": ("agreement.py",),
    "gather / release": ("flat_group.py", "gather.py", "gathers.py", "released.py"),
    "buffers & ledger": ("buffers.py", "parking.py", "libc.py"),
    "reductions": ("reduction.py", "gradients.py"),
    "collectives": ("communicator.py", "records.py"),
}
ORDER = [*PARTS, "waiting", "optimizer", "not zero3"]


def part_of(filename: str, function: str, caller_part: str | None = None) -> str:
    """The part a function's own time is charged to (a C function's: its caller's part)."""
    if filename == "~":  # a C function: where it was called from decides, waits on collectives apart
        if caller_part is not None and caller_part != "not zero3" and "wait" in function:
            return "waiting"
        return caller_part or "not zero3"
    if "lightning_zero3" not in filename:
        return "not zero3"
    name = Path(filename).name
    return next((part for part, files in PARTS.items() if name in files), "optimizer")


def charge(stats: pstats.Stats) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """Own seconds and Python calls of each part (a C function's time split over its callers), and the own
    seconds of each of zero3's functions (a C function by the zero3 function that called it)."""
    parts = {part: {"seconds": 0.0, "calls": 0} for part in ORDER}
    functions: dict[str, float] = {}
    for (filename, _, function), (_, calls, own, _, callers) in stats.stats.items():  # type: ignore[attr-defined]
        if filename != "~":
            part = part_of(filename, function)
            parts[part]["seconds"] += own
            if part != "not zero3":
                parts[part]["calls"] += calls
                name = f"{Path(filename).name}:{function}"
                functions[name] = functions.get(name, 0.0) + own
            continue
        for (caller_file, _, caller_function), edge in callers.items():
            part = part_of("~", function, part_of(caller_file, caller_function))
            parts[part]["seconds"] += edge[2]
            if part != "not zero3":
                name = f"{function.strip('<>')} in {Path(caller_file).name}:{caller_function}"
                functions[name] = functions.get(name, 0.0) + edge[2]
    return parts, functions


def profiled_seconds_per_call() -> float:
    """What the profiler adds to one Python call on this machine (an empty function, profiled and not)."""

    def empty() -> None:
        pass

    n = 200_000
    start = time.perf_counter()
    for _ in range(n):
        empty()
    bare = time.perf_counter() - start
    profiler = cProfile.Profile()
    profiler.enable()
    start = time.perf_counter()
    for _ in range(n):
        empty()
    profiled = time.perf_counter() - start
    profiler.disable()
    return (profiled - bare) / n


def worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    from benchmark import dataset, model_config, zero3_knobs
    from gpt import GPTModule
    from torch.utils.data import DataLoader

    import lightning_zero3

    class Profiled(pl.Callback):
        def __init__(self) -> None:
            self.profiler = cProfile.Profile()
            self.step_times: list[float] = []
            self._start = 0.0

        # the profiler covers exactly the timed steps (it adds up over enable / disable), so its parts
        # are shares of those steps' time, not of the loop's work between them
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx >= args.warmup:
                self._start = time.perf_counter()
                self.profiler.enable()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx >= args.warmup:
                self.profiler.disable()
                self.step_times.append(time.perf_counter() - self._start)

    pl.seed_everything(0)
    probe = Profiled()
    strategy = lightning_zero3.Zero3Strategy(**zero3_knobs(args.zero3))
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=args.devices, max_steps=args.steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[probe])  # fmt: skip
    trainer.fit(GPTModule(model_config(args)), DataLoader(dataset(args), batch_size=args.batch_size))
    steps = len(probe.step_times)
    profile = pstats.Stats(probe.profiler)
    parts, functions = charge(profile)
    mine = [parts[p]["seconds"] / steps for p in ORDER] + [parts[p]["calls"] / steps for p in ORDER]
    mine += [profile.total_tt / steps, sum(probe.step_times) / steps]  # type: ignore[attr-defined]
    figures = trainer.strategy.reduce(torch.tensor(mine, dtype=torch.float64), reduce_op="mean")
    if trainer.is_global_zero:
        n = len(ORDER)
        result = {
            "units": len(trainer.strategy.engine.runtimes),
            "step_seconds": figures[-1].item(),
            "profiled_seconds": figures[-2].item(),  # every function's own time in the profile, per step
            "seconds": dict(zip(ORDER, figures[:n].tolist())),
            "calls": dict(zip(ORDER, figures[n : 2 * n].tolist())),
            "profiler_seconds_per_call": profiled_seconds_per_call(),
            # rank 0's own: the functions that cost zero3 most, ms per step
            "top": sorted(((1e3 * t / steps, f) for f, t in functions.items()), reverse=True)[: args.top],
        }
        Path(args.result).write_text(json.dumps(result))


def table(result: dict) -> str:
    units, step = result["units"], result["step_seconds"]
    rows = ["part             | ms/step | ms/unit/step | share of step | Python calls/unit/step",
            "-----------------+---------+--------------+---------------+-----------------------"]  # fmt: skip
    for part in ORDER:
        seconds, calls = result["seconds"][part], result["calls"][part]
        per_unit = f"{1e3 * seconds / units:12.3f}" if part != "not zero3" else f"{'':12}"
        call_text = f"{calls / units:.0f}" if part not in ("not zero3", "waiting") else ""
        rows.append(f"{part:16} | {1e3 * seconds:7.1f} | {per_unit} | {seconds / step:13.1%} | {call_text}")
    zero3 = sum(result["seconds"][p] for p in ORDER if p not in ("not zero3", "waiting"))
    calls = sum(result["calls"][p] for p in ORDER)
    inflation = calls * result["profiler_seconds_per_call"]
    rows.append(
        f"\n{units} units; step {1e3 * step:.1f} ms under the profiler; zero3's own host work {1e3 * zero3:.1f} ms "
        f"({zero3 / step:.1%}), {calls:.0f} Python calls per step, of which the profiler's own cost is about "
        f"{1e3 * inflation:.1f} ms ({1e6 * result['profiler_seconds_per_call']:.2f} us per call)"
    )
    if result["top"]:
        rows.append("\nzero3's costliest functions on rank 0 (own time, ms per step; C functions by their caller):")
        rows.extend(f"{ms:8.2f}  {name}" for ms, name in result["top"])
    return "\n".join(rows)


def main(argv=None) -> dict:
    from benchmark import parse_args  # the benchmark's options and defaults: model shape, batch, steps, --zero3

    argv = list(sys.argv[1:] if argv is None else argv)
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--top", type=int, default=0, help="also list the N functions that cost zero3 most")
    mine, rest = own.parse_known_args(argv)
    args = parse_args(rest)
    args.top = mine.top
    if args.result is not None:  # a rank (Lightning's launcher starts the others from the same command)
        worker(args)
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        command = [sys.executable, __file__, *argv, "--result", str(result)]
        subprocess.run(command, check=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
        figures = json.loads(result.read_text())
    print(table(figures))
    return figures


if __name__ == "__main__":
    main()
