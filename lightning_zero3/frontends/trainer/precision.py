"""``Zero3Precision``: the precision plugin zero3 always runs with.

Lightning hands a strategy whatever plugin the ``precision=`` flag selected; ``Zero3Strategy`` turns it
into this class (``to_zero3_precision``), as Lightning does for FSDP, so the user's flag is honoured:

=============  ==============  ================  ================  ===========
flag           shards, optim   gathered/compute  reduce (default)  loss scale
=============  ==============  ================  ================  ===========
``32-true``    fp32            fp32              fp32              -
``bf16-mixed`` fp32 (master)   bf16 + autocast   fp32 (or bf16)    -
``16-mixed``   fp32 (master)   fp16 + autocast   fp32 (or fp16)    sharded, dynamic
``bf16-true``  bf16            bf16              bf16              -
``16-true``    fp16            fp16              fp16              -
=============  ==============  ================  ================  ===========

It also owns what a generic plugin gets wrong on shards: clipping by norm uses the norm of the *full*
gradient (through the engine), and the fp16 overflow check is agreed by all ranks (``ShardedLossScaler``).
Gradients are unscaled before clipping, so clipping is exact under every flag.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch.optim import Optimizer

from ...config.precision_flags import SUPPORTED_PRECISION
from ...errors import UnsupportedPrecisionError
from ..precision_core import PrecisionCore, translate_precision


class Zero3Precision(PrecisionCore, Precision):
    """The Trainer's zero3 precision plugin (``PrecisionCore`` holds what it shares with Fabric's)."""

    grad_norm: Optional[torch.Tensor] = None  # the global gradient norm of the last clipping, until reported
    step_skipped: bool = False  # the fp16 loss scaler found inf/NaN gradients and skipped the last step

    # -- backward and step ------------------------------------------------------------------------

    def pre_backward(self, tensor: torch.Tensor, module: "pl.LightningModule") -> torch.Tensor:  # type: ignore[override]
        return super().pre_backward(self.scale_loss(tensor), module)

    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizable, model: "pl.LightningModule", closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        skipped_backward = closure_result is None and model.automatic_optimization
        found_inf = False
        if not skipped_backward:
            found_inf = self.scaler.unscale_and_check(self._require_engine(), list(self.main_params(optimizer)))
        self.step_skipped = found_inf
        self._after_closure(model, optimizer)  # hooks and clipping see unscaled gradients
        if skipped_backward:
            return closure_result
        if not found_inf:
            optimizer.step(**kwargs)
        self.scaler.update(found_inf)
        return closure_result

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        engine = self._require_engine()
        self.grad_norm = engine.clip_grad_norm_(float(clip_val), params=list(self.main_params(optimizer)))

    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        self._require_engine().clip_grad_value_(float(clip_val), params=list(self.main_params(optimizer)))



def check_device_supports(plugin: Zero3Precision, accelerator: Any) -> None:
    """Refuse, at Trainer construction, a flag the chosen accelerator cannot run."""
    kind = type(accelerator).__name__ if accelerator is not None else None
    if kind not in (None, "CPUAccelerator", "CUDAAccelerator"):
        raise UnsupportedPrecisionError(
            f"zero3 runs on `accelerator='cpu'` or `'cuda'`, not {kind}; choose one of those."
        )
    if kind == "CUDAAccelerator" and plugin.compute_dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        works = [flag for flag in SUPPORTED_PRECISION if not flag.startswith("bf16")]
        raise UnsupportedPrecisionError(
            f"zero3: `precision={plugin.precision!r}` needs a GPU with bfloat16 support and this one has none; "
            f"use one of {works}."
        )


def to_zero3_precision(plugin: Optional[Precision]) -> Optional[Zero3Precision]:
    """Translate the plugin Lightning picked from the ``precision=`` flag into ``Zero3Precision``."""
    return translate_precision(plugin, Zero3Precision, (Precision, MixedPrecision, HalfPrecision))
