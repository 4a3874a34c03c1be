"""Loss curves of several runs side by side, read back from the TensorBoard event files they logged.

Question: Do two runs' loss curves agree (for example int8 gathers against full precision)?

    python examples/benchmarks/loss_curves.py runs/gpt-none/version_0 runs/gpt-int8/version_0 --every 25

Prints, for each logged step that ends a block of ``--every`` steps (steps counted from 1), each run's
``--tag`` (default ``train_loss``) and its difference from the first run, relative; then the last value of
``val_loss`` of each run (if logged) the same way. Runs with the same seed and data see the same batches,
so the differences are the runs' own.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def scalars(run: Path, tag: str) -> dict[int, float]:
    """``{step: value}`` of ``tag`` in the event files under ``run``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run), size_guidance={"scalars": 0}).Reload()
    if tag not in events.Tags()["scalars"]:
        return {}
    return {event.step: event.value for event in events.Scalars(tag)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="log directories (the first is the reference)")
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--tag", default="train_loss")
    args = parser.parse_args()
    names = [run.parent.name if run.name.startswith("version_") else run.name for run in args.runs]
    curves = [scalars(run, args.tag) for run in args.runs]
    steps = sorted(s for s in curves[0] if (s + 1) % args.every == 0 and all(s in c for c in curves))
    print(" | ".join(["step", *names, *[f"{n} vs {names[0]}" for n in names[1:]]]))
    for step in steps:
        values = [curve[step] for curve in curves]
        diffs = [f"{(v - values[0]) / values[0]:+.2%}" for v in values[1:]]
        print(" | ".join([str(step + 1), *(f"{v:.4f}" for v in values), *diffs]))
    finals = [scalars(run, "val_loss") for run in args.runs]
    if all(finals):
        last = [final[max(final)] for final in finals]
        diffs = [f"{(v - last[0]) / last[0]:+.2%}" for v in last[1:]]
        print(" | ".join([f"val_loss at step {max(finals[0]) + 1}", *(f"{v:.4f}" for v in last), *diffs]))


if __name__ == "__main__":
    main()
