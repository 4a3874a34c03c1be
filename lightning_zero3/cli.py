"""The ``lightning-zero3`` command: Lightning's own LightningCLI, with zero3 imported and registered.

    lightning-zero3 fit --config examples/configs/gpt_zero3.yaml
    lightning-zero3 fit --config examples/configs/gpt_zero3.yaml --print_config
    lightning-zero3 env [--json] [--nvme-path DIR]     # versions, devices, NVMe I/O: see env_report.py
    lightning-zero3 estimate --config examples/configs/gpt_zero3.yaml     # will it fit (estimate/command.py)
    python -m lightning_zero3.cli fit --trainer.strategy zero3 --model ... --data ...

Importing the package registers ``strategy: zero3`` (and the offload names); ``class_path:
lightning_zero3.Zero3Strategy`` with ``init_args`` works too, each setting typed and documented (see
``knobs.py``), so a wrong name or value fails while the config is parsed, naming the field. Model and
data module are given by ``class_path``, as with any LightningCLI in subclass mode.

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


def main(args: ArgsType = None) -> int:
    """The console script: exit status 0 when the subcommand finished (errors exit non-zero on their own).
    ``env`` (``env_report.py``) and ``estimate`` (``estimate/command.py``) are ours; every other subcommand
    is LightningCLI's."""
    argv = sys.argv[1:] if args is None else args
    if isinstance(argv, list) and argv[:1] == ["env"]:  # not a LightningCLI subcommand: the machine's report
        from .env_report import main as env_main

        return env_main(argv[1:])
    if isinstance(argv, list) and argv[:1] == ["estimate"]:
        from .estimate.command import main as estimate

        return estimate(argv[1:])
    build_cli(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
