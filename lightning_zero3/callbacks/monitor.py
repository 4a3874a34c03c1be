"""What the zero3 monitors share: when they log, how figures are aggregated across ranks, where they go.

Every ``every_n_steps`` optimizer steps (default: the Trainer's ``log_every_n_steps``) each rank computes
its figures; a torchmetrics ``CatMetric`` gathers them from all ranks of the engine's group (one
collective per monitor, at the same step on every rank), on the device that group's collectives run on
(``engine.comm.device``: an NCCL group cannot all-gather host tensors), and rank 0 logs each figure's
mean and max over the ranks through the Trainer's loggers as ``zero3/<section>/<figure>/mean`` and ``.../max``. A figure that is undefined for
an interval (say a bandwidth with no collective of that kind) is NaN on every rank and is not logged.

Advice: ``advise`` returns ``(key, message)`` pairs; each key is warned about once per run, and written as
a TensorBoard text entry ``zero3/advice/<key>``. The custom-scalars layout of all monitors is merged
on the TensorBoard writer, so the charts open grouped whichever monitors are on.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torchmetrics.aggregation import CatMetric

Figures = dict[str, float]
Layout = dict[str, dict[str, list]]


class Zero3MonitorError(RuntimeError):
    """A zero3 monitor was used where it cannot work (no zero3 engine, bad argument)."""


class Zero3Monitor(Callback):
    section = ""  # "memory" or "comm": the tag prefix is zero3/<section>/

    def __init__(self, every_n_steps: Optional[int] = None) -> None:
        if every_n_steps is not None and (isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1):
            raise Zero3MonitorError(
                f"{type(self).__name__}: `every_n_steps` must be a positive integer or None, got {every_n_steps!r}."
            )
        self.every_n_steps = every_n_steps
        self._every = 1
        self._last_step = -1
        self._warned: set[str] = set()
        self._aggregate: Optional[CatMetric] = None
        self._device = torch.device("cpu")  # where the figures are gathered: the engine group's device
        self.engine: Any = None
        self.last_logged: dict[str, float] = {}  # what rank 0 logged last (for tests and scripts)

    # -- to be provided by each monitor -----------------------------------------------------------

    def start(self, trainer: "pl.Trainer") -> None:
        """Called once training starts, on every rank (the engine exists)."""

    def figures(self, trainer: "pl.Trainer") -> Figures:
        """This rank's figures for the interval that ends now (same names, same order on every rank)."""
        raise NotImplementedError

    def advise(self, mean: Figures, maximum: Figures, trainer: "pl.Trainer") -> list[tuple[str, str]]:
        return []

    def layout(self) -> Layout:
        return {}

    # -- Lightning hooks --------------------------------------------------------------------------

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.engine = getattr(trainer.strategy, "engine", None)
        if self.engine is None:
            raise Zero3MonitorError(
                f"{type(self).__name__} reads the zero3 engine's accounting, and this Trainer's strategy "
                f"({type(trainer.strategy).__name__}) has none: use strategy='zero3' (after `import lightning_zero3`)."
            )
        self._every = self.every_n_steps or trainer.log_every_n_steps or 1
        self._last_step = trainer.global_step
        comm = self.engine.comm
        self._device = comm.device
        self._aggregate = CatMetric(nan_strategy="disable", process_group=comm.group).to(self._device)
        self.start(trainer)
        if trainer.is_global_zero:
            _write_layout(trainer, self.layout())

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", *args: Any) -> None:
        step = trainer.global_step
        if step == self._last_step or step % self._every:
            return
        self._last_step = step
        mine = self.figures(trainer)
        mean, maximum = self._across_ranks(mine)
        if trainer.is_global_zero:
            logged = {f"zero3/{self.section}/{name}/mean": v for name, v in mean.items() if math.isfinite(v)}
            logged |= {f"zero3/{self.section}/{name}/max": v for name, v in maximum.items() if math.isfinite(v)}
            for logger in trainer.loggers:
                logger.log_metrics(logged, step=step)
            self.last_logged = logged
        for key, message in self.advise(mean, maximum, trainer):
            self._advise_once(trainer, key, message, step)

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.engine = None

    # -- helpers ----------------------------------------------------------------------------------

    def _row(self, figures: Figures) -> torch.Tensor:
        """This rank's figures as one row, on the device the engine's group gathers on."""
        return torch.tensor(list(figures.values()), dtype=torch.float64, device=self._device)

    def _across_ranks(self, figures: Figures) -> tuple[Figures, Figures]:
        assert self._aggregate is not None
        names = list(figures)
        self._aggregate.update(self._row(figures))
        table = self._aggregate.compute().reshape(-1, len(names))  # one row per rank (a collective)
        self._aggregate.reset()
        mean, maximum = table.mean(dim=0).tolist(), table.max(dim=0).values.tolist()
        return dict(zip(names, mean)), dict(zip(names, maximum))

    def _advise_once(self, trainer: "pl.Trainer", key: str, message: str, step: int) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        rank_zero_warn(f"zero3 advice: {message}")
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                if isinstance(logger, TensorBoardLogger):
                    logger.experiment.add_text(f"zero3/advice/{key}", message, global_step=step)


def _write_layout(trainer: "pl.Trainer", layout: Layout) -> None:
    """Merge ``layout`` into the custom-scalars layout kept on each TensorBoard writer, and write the union.

    [Note: one layout per run]
    TensorBoard's custom-scalars page reads the *last* layout written to a run, so two monitors writing
    their own would hide each other's charts; each writes the union of all layouts so far instead.
    """
    for logger in trainer.loggers:
        if not isinstance(logger, TensorBoardLogger):
            continue
        writer = logger.experiment
        merged: Layout = getattr(writer, "_zero3_layout", {})
        for category, charts in layout.items():
            merged.setdefault(category, {}).update(charts)
        writer._zero3_layout = merged
        writer.add_custom_scalars(merged)
