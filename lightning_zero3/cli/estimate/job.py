"""A job as the estimate sees it: a model on the meta device, how to run one training forward of it, the
zero3 settings, the precision, the ranks.

From the ``fit`` YAML: LightningCLI parses and instantiates it as ``fit`` would (no process is launched),
under ``torch.device("meta")`` so that no weight is allocated, and the module's ``configure_model`` runs
there too. One training forward is ``training_step((tokens, tokens), 0)`` on meta token ids of the
data's batch size and sequence length (``batch_size`` and ``block_size`` / ``seq_len`` / ``max_length`` of
the data module, or ``--batch-size`` / ``--seq-len``): the shape of a language model's batch. The module's
``prepare_data`` runs first, as in ``fit`` (a fine-tuning job's ``configure_model`` reads its checkpoint's
config, written there for the sample model when no checkpoint is given; no weight is read).

From a Hugging Face config (a directory or its ``config.json``): ``AutoModelForCausalLM.from_config`` on
the meta device, one forward with ``labels``.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from ...config.precision_flags import PRECISION_FLAGS, SHORT_NAMES
from ...config.settings import Zero3Config



@dataclass
class JobSpec:
    model: nn.Module  # on the meta device
    step: Callable[[], object]  # one training forward and loss of ``model``
    config: Zero3Config
    precision: str
    devices: int
    num_nodes: int
    batch_size: int
    seq_len: int
    on_cpu: bool
    activation_checkpointing: bool = False
    label: str = ""


def _precision_name(value) -> str:
    text = str(value)
    return SHORT_NAMES.get(text, text)


def from_yaml(path: str, overrides: list[str], batch_size: Optional[int], seq_len: Optional[int]) -> JobSpec:
    """The job that ``lightning-zero3 fit --config path [overrides]`` would run, its model on meta."""
    from ..fit import build_cli

    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        cli = build_cli(["--config", path, *overrides], run=False)
        module = cli.model
    # fit runs the module's prepare_data before configure_model: a job whose configure_model reads a
    # checkpoint's config finds it there (the fine-tuning jobs write their small sample model in it when
    # none is given, and name a given one that is missing). Outside the meta device: it may write files.
    # The data module's prepare_data is not run (it may download data, which the estimate does not need).
    module.prepare_data()
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        module.configure_model()
    trainer, data = cli.trainer, cli.datamodule
    strategy = trainer.strategy
    config = getattr(strategy, "config", None) or Zero3Config()
    batch = batch_size or int(getattr(data, "batch_size", 1))
    # a jsonl module pads each batch to its longest row, cut at max_length: the longest a batch can be
    seq = seq_len or int(getattr(data, "block_size", 0) or getattr(data, "seq_len", 0) or
                         getattr(data, "max_length", 0) or 0)  # fmt: skip
    if not seq:
        raise SystemExit("lightning-zero3 estimate: give --seq-len (the data module has no block_size / seq_len / "
                         "max_length).")  # fmt: skip
    tokens = torch.zeros(batch, seq, dtype=torch.long, device="meta")

    def step() -> object:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # self.log without a Trainer
            return module.training_step((tokens, tokens), 0)

    devices = len(trainer.device_ids) if trainer.device_ids else 1
    return JobSpec(
        model=module, step=step, config=config, precision=_precision_name(trainer.precision), devices=devices,
        num_nodes=trainer.num_nodes, batch_size=batch, seq_len=seq, on_cpu=trainer.accelerator.__class__.__name__ ==
        "CPUAccelerator", label=path,
    )  # fmt: skip


def from_hf(source: str, config: Zero3Config, precision: str, devices: int, num_nodes: int, batch_size: int,
            seq_len: int, on_cpu: bool = False) -> JobSpec:  # fmt: skip
    """A Hugging Face causal LM from its config alone (a directory holding ``config.json``, or the file)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(source)
    file = path / "config.json" if path.is_dir() else path
    values = json.loads(file.read_text())
    model_type = values.pop("model_type", "llama")
    hf_config = AutoConfig.for_model(model_type, **values)
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa")
    tokens = torch.zeros(batch_size, seq_len, dtype=torch.long, device="meta")
    # 16-bit runs: measured with the model in that dtype (autocast does not act on meta tensors; it would
    # keep a few ops, softmax and the loss, in fp32: the figure is a little low there)
    if precision != "32-true":
        model.to(PRECISION_FLAGS[precision].compute)

    def step() -> object:
        return model(input_ids=tokens, labels=tokens).loss

    return JobSpec(model=model, step=step, config=config, precision=precision, devices=devices, num_nodes=num_nodes,
                   batch_size=batch_size, seq_len=seq_len, on_cpu=on_cpu, label=str(file))  # fmt: skip

