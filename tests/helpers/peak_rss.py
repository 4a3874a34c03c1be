"""A callback for tests that run a job through the CLI: each rank writes its whole-run peak resident memory
and the loss of every training step.

The kernel's high-water mark (``VmHWM``) is read when the rank's ``fit`` has ended (``teardown``), and written
to ``$ZERO3_PEAK_RSS_DIR/rank<N>.json`` with the losses and the offload plan the engine ran (``plan``: the
two offload settings after "auto" was resolved, and why).

With ``ZERO3_PHASE_PEAKS=1`` it also records, for every training step, the peak resident bytes of each
phase (forward, backward, optimizer step) and of setup, by resetting the kernel's high-water mark at
each phase's start (``/proc/self/clear_refs``): ``phases`` in the record, with the engine's byte ledger
at the end of the first step. The whole-run ``peak_rss`` is then the highest of them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning.pytorch as pl


def peak_rss() -> int:
    return _status("VmHWM")


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


class PeakRSS(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.plan = None
        self.trace = os.environ.get("ZERO3_PHASE_PEAKS") == "1"
        self.phases: list[dict] = []
        self.whole = 0
        self.ledger = None

    def _phase(self, name: str) -> None:
        """Close the phase that ran until now (its peak) and start the next."""
        if self.trace:
            peak = peak_rss()
            self.whole = max(self.whole, peak)
            engine = getattr(self.strategy, "_engine", None)
            ledger = engine.memory_report() if engine is not None else {}
            self.phases.append({"phase": name, "peak": peak, "rss": _status("VmRSS"),
                                "ledger": {k: v for k, v in ledger.items() if not k.startswith("peak_")}})  # fmt: skip
            _reset_peak()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.strategy = trainer.strategy
        self._phase("setup" if not self.phases else "between steps")

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self._phase(f"forward {len(self.losses)}")

    def on_after_backward(self, trainer, pl_module) -> None:
        self._phase(f"backward {len(self.losses)}")

    def on_train_start(self, trainer, pl_module) -> None:
        engine = getattr(trainer.strategy, "_engine", None)
        if engine is not None:
            self.plan = {"offload_optimizer": engine.config.offload_optimizer,
                         "offload_params": engine.config.offload_params, "why": engine.plan_choice}  # fmt: skip

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss.detach()))
        self._phase(f"optimizer step {len(self.losses) - 1}")
        engine = getattr(trainer.strategy, "_engine", None)
        if self.trace and self.ledger is None and engine is not None:
            self.ledger = engine.memory_report()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        out = Path(os.environ["ZERO3_PEAK_RSS_DIR"])
        out.mkdir(parents=True, exist_ok=True)
        self._phase("after the last step")
        record = {"peak_rss": max(peak_rss(), self.whole), "rank": trainer.global_rank, "stage": stage,
                  "losses": self.losses, "plan": self.plan}  # fmt: skip
        if self.trace:
            estimate = getattr(getattr(trainer.strategy, "_engine", None), "plan_estimate", None)
            record.update(phases=self.phases, ledger=self.ledger, estimate=estimate and estimate.as_dict())
        (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))
