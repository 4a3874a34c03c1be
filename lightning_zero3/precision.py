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

from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Generator, Optional, Union

import torch
from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.optim import Optimizer

import lightning.pytorch as pl

from .config import DTYPES, SUPPORTED_PRECISION
from .errors import UnsupportedPrecisionError
from .engine import Zero3Engine
from .engine.scaler import ShardedLossScaler
from .engine.shard import DtypePolicy

_COMPUTE = {"32-true": torch.float32, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16,
            "bf16-true": torch.bfloat16, "16-true": torch.float16}  # fmt: skip


class Zero3Precision(Precision):
    def __init__(self, precision: str = "32-true", scaler: Optional[ShardedLossScaler] = None) -> None:
        if precision not in SUPPORTED_PRECISION:
            raise UnsupportedPrecisionError(
                f"zero3: `precision={precision!r}` is not supported; use one of {list(SUPPORTED_PRECISION)}."
            )
        if scaler is not None and precision != "16-mixed":
            raise UnsupportedPrecisionError(f"zero3: a loss scaler only applies to '16-mixed', not {precision!r}.")
        self.precision = precision
        self.compute_dtype = _COMPUTE[precision]
        self.mixed = precision.endswith("-mixed")
        self.master_dtype = torch.float32 if self.mixed or precision == "32-true" else self.compute_dtype
        self.scaler = scaler or (ShardedLossScaler() if precision == "16-mixed" else None)
        self.engine: Optional[Zero3Engine] = None
        self.device_type = "cpu"  # set by the strategy at setup, for autocast

    def dtype_policy(self, reduce_dtype: Optional[str]) -> DtypePolicy:
        """The engine's dtypes for this flag and the ``reduce_dtype`` setting (checked against each other)."""
        allowed = {torch.float32, self.compute_dtype} if self.mixed else {self.master_dtype}
        reduce = DTYPES[reduce_dtype] if reduce_dtype else self.master_dtype
        if reduce not in allowed:
            names = sorted(name for name, dtype in DTYPES.items() if dtype in allowed)
            raise UnsupportedPrecisionError(
                f"zero3: `reduce_dtype={reduce_dtype!r}` does not go with `precision={self.precision!r}`; "
                f"use one of {names} (or None for the default)."
            )
        return DtypePolicy(compute=self.compute_dtype, reduce=reduce)

    # -- module, inputs, forward ------------------------------------------------------------------

    def convert_module(self, module: nn.Module) -> nn.Module:
        return module if self.master_dtype == torch.float32 else module.to(dtype=self.master_dtype)

    def convert_input(self, data: Any) -> Any:
        if self.mixed or self.precision == "32-true":
            return data
        return apply_to_collection(data, torch.Tensor, _to_dtype_if_float, self.compute_dtype)

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.mixed:
            context = torch.autocast(self.device_type, dtype=self.compute_dtype, cache_enabled=False)
        else:
            context = nullcontext()
        with context:
            yield

    # -- backward and step ------------------------------------------------------------------------

    def pre_backward(self, tensor: torch.Tensor, module: "pl.LightningModule") -> torch.Tensor:  # type: ignore[override]
        if self.scaler is not None:
            tensor = self.scaler.scale_loss(tensor)
        return super().pre_backward(tensor, module)

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
        self._after_closure(model, optimizer)  # hooks and clipping see unscaled gradients
        if skipped_backward:
            return closure_result
        if not found_inf:
            optimizer.step(**kwargs)
        self.scaler.update(found_inf)
        return closure_result

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        self._require_engine().clip_grad_norm_(float(clip_val), params=list(self.main_params(optimizer)))

    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        self._require_engine().clip_grad_value_(float(clip_val), params=list(self.main_params(optimizer)))

    def _require_engine(self) -> Zero3Engine:
        if self.engine is None:
            raise RuntimeError("zero3: the precision plugin was used before the strategy set up its engine.")
        return self.engine

    # -- checkpointed state -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)


def _to_dtype_if_float(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype) if torch.is_floating_point(tensor) else tensor


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
    if plugin is None or isinstance(plugin, Zero3Precision):
        return plugin
    flag = getattr(plugin, "precision", None)
    if type(plugin) in (Precision, MixedPrecision, HalfPrecision) and flag in SUPPORTED_PRECISION:
        return Zero3Precision(flag)
    raise UnsupportedPrecisionError(
        f"zero3: `precision={flag or type(plugin).__name__!r}` ({type(plugin).__name__}) is not supported by the "
        f"zero3 strategy; use one of {list(SUPPORTED_PRECISION)}."
    )
