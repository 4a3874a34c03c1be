"""The fine-tuning job's module as each peer loads a checkpoint, and a callback that times the start of a
run (``benchmark_startup.py`` runs them through ``lightning-zero3 fit``).

- ``FromPretrained``: ``CausalLMFineTune`` loading with transformers' ``from_pretrained`` (DDP's way, and
  DeepSpeed's: under ``HfDeepSpeedConfig`` it builds inside ``zero.Init`` with ``no_init_weights``);
- ``FSDP2FineTune``: built on the meta device, ``fully_shard`` per decoder layer and the root, then rank 0
  reads the checkpoint and ``set_model_state_dict(..., broadcast_from_rank0=True)`` sends each tensor out
  (for Lightning's ``ModelParallelStrategy``, which needs ``configure_model`` to shard);
- ``StartupTimes``: the wall-clock time (``time.time()``) of each phase on every rank, from the command's
  start (``STARTUP_T0`` in the environment), written to ``STARTUP_OUT/rank<R>.json`` once the first
  optimizer step has ended; the checkpoint's read is timed inside the loaders
  (``transformers``' ``_load_pretrained_model``, zero3's ``load_sources``, the FSDP2 broadcast).
"""

from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

from examples.finetune import CausalLMFineTune

# time spent reading the checkpoint into the model in this process, by the phase it fell in
READ_SECONDS = {"configure": 0.0, "setup": 0.0}
PHASE = ["configure"]


def _timed_read(function):
    @functools.wraps(function)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            READ_SECONDS[PHASE[0]] += time.perf_counter() - start

    return timed


def _time_the_reads() -> None:
    import transformers.modeling_utils as hf

    import lightning_zero3.engine.engine as zero3_engine

    hf.PreTrainedModel._load_pretrained_model = staticmethod(_timed_read(hf.PreTrainedModel._load_pretrained_model))
    zero3_engine.load_sources = _timed_read(zero3_engine.load_sources)


class FromPretrained(CausalLMFineTune):
    """``CausalLMFineTune`` with the model from ``from_pretrained`` (the peers' way)."""

    def pretrained(self, auto_class) -> torch.nn.Module:
        return auto_class.from_pretrained(self.checkpoint, dtype=torch.float32)


class FSDP2FineTune(CausalLMFineTune):
    """``CausalLMFineTune`` sharded by FSDP2 in ``configure_model``, loaded by a broadcast from rank 0."""

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from benchmark_load import fsdp2_broadcast, fsdp2_build

        model = fsdp2_build(Path(self.checkpoint))
        _timed_read(fsdp2_broadcast)(model, Path(self.checkpoint))
        self.model = model


class StartupTimes(pl.Callback):
    """Phase times of the start of a run on this rank (see the module docstring)."""

    def __init__(self) -> None:
        _time_the_reads()
        self.t0 = float(os.environ["STARTUP_T0"])
        self.marks: dict[str, float] = {"imported": time.time()}

    def _mark(self, name: str) -> None:
        self.marks.setdefault(name, time.time())

    def setup(self, trainer, module, stage) -> None:
        self._mark("launched")  # the process group is up, on every rank
        configure = module.configure_model

        def timed_configure() -> None:
            self._mark("configure_start")
            configure()
            self._mark("configure_end")
            PHASE[0] = "setup"

        module.configure_model = timed_configure

    def on_fit_start(self, trainer, module) -> None:
        self._mark("engine_ready")  # the strategy has sharded the model and set up the optimizer

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self._mark("first_batch")

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self._mark("first_step_end")
        marks = {k: v - self.t0 for k, v in self.marks.items()}
        marks.update({f"read_in_{phase}": seconds for phase, seconds in READ_SECONDS.items()})
        out = Path(os.environ["STARTUP_OUT"])
        (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(marks))
