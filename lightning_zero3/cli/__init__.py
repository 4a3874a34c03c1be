"""The ``lightning-zero3`` command: Lightning's own LightningCLI, with zero3 imported and registered.

    lightning-zero3 fit --config examples/configs/gpt_zero3.yaml
    lightning-zero3 fit --config examples/configs/gpt_zero3.yaml --print_config
    lightning-zero3 env [--json] [--nvme-path DIR]     # versions, devices, NVMe I/O: see cli/env.py
    lightning-zero3 estimate --config examples/configs/gpt_zero3.yaml     # will it fit (cli/estimate/command.py)
    lightning-zero3 verify DIR       # a sharded checkpoint or export against its checksums (checkpoint/verify.py)
    python -m lightning_zero3.cli fit --trainer.strategy zero3 --model ... --data ...

Importing the package registers ``strategy: zero3`` (and the offload names); ``class_path:
lightning_zero3.Zero3Strategy`` with ``init_args`` works too, each setting typed and documented (see
``config/knobs.py``), so a wrong name or value fails while the config is parsed, naming the field. Model and
data module are given by ``class_path``, as with any LightningCLI in subclass mode.

Class paths resolve from the working directory as well as from installed packages (as under
``python -m``), so ``examples.gpt.GPTModule`` works from a checkout of this repository.

The command line, all of it (the top layer: it imports anything of the package):

    __init__.py  ``main``: the subcommand dispatch (``lightning-zero3``)
    fit.py       the LightningCLI that ``fit`` (and every other Lightning subcommand) runs
    env.py       ``lightning-zero3 env``: versions, devices, NVMe I/O
    estimate/    ``lightning-zero3 estimate``: will a job fit, and with which offload plan

``zero3-consolidate`` is ``checkpoint/consolidate.py``'s ``main``.
"""

from __future__ import annotations

import sys

from lightning.pytorch.cli import ArgsType

from .fit import build_cli


def main(args: ArgsType = None) -> int:
    """The console script: exit status 0 when the subcommand finished (errors exit non-zero on their own).
    ``env`` (``env.py``), ``estimate`` (``cli/estimate/command.py``) and ``verify``
    (``checkpoint/verify.py``) are ours; every other subcommand is LightningCLI's."""
    argv = sys.argv[1:] if args is None else args
    if isinstance(argv, list) and argv[:1] == ["env"]:  # not a LightningCLI subcommand: the machine's report
        from .env import main as env_main

        return env_main(argv[1:])
    if isinstance(argv, list) and argv[:1] == ["estimate"]:
        from .estimate.command import main as estimate

        return estimate(argv[1:])
    if isinstance(argv, list) and argv[:1] == ["verify"]:  # a checkpoint or export against its checksums
        from ..checkpoint.verify import main as verify

        return verify(argv[1:])
    build_cli(args)
    return 0

