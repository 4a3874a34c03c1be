"""The LightningCLI that ``lightning-zero3 fit`` (``cli/__init__.py``) and the estimator (``cli/estimate/job.py``) build
from a job's YAML: Lightning's own, with zero3 imported and registered.

Class paths resolve from the working directory as well as from installed packages (as under
``python -m``), so ``examples.gpt.GPTModule`` works from a checkout of this repository.
"""

from __future__ import annotations

import os
import sys
import warnings

import lightning.pytorch as pl
from lightning.pytorch.cli import ArgsType, LightningCLI

import lightning_zero3  # noqa: F401  (registers the strategy names)

# Lightning 2.6's CombinedLoader builds a torch ``LeafSpec`` for every dataloader, which torch 2.13
# deprecates: a FutureWarning per rank at the first batch of any Lightning job, not caused by zero3 and
# nothing a user can act on. Silenced for this command only, by message and module.
warnings.filterwarnings(
    "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning,
    module=r"lightning\.pytorch\.utilities\._pytree",
)


class Zero3CLI(LightningCLI):
    """Lightning's CLI; the default progress bar leaves out ``v_num`` (the logger's version, already in the
    log directory's name), which the rich bar prints as if it were a metric (``v_num: 0.000``)."""

    def instantiate_trainer(self, **kwargs):
        from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

        trainer = super().instantiate_trainer(**kwargs)
        bar = trainer.progress_bar_callback
        if bar is not None and type(bar) in (RichProgressBar, TQDMProgressBar):
            metrics = bar.get_metrics
            bar.get_metrics = lambda *a, **k: {n: v for n, v in metrics(*a, **k).items() if n != "v_num"}
        return trainer


def build_cli(args: ArgsType = None, run: bool = True) -> LightningCLI:
    """The LightningCLI itself (``run=False`` parses and instantiates without running a subcommand)."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return Zero3CLI(
        pl.LightningModule,
        pl.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )
