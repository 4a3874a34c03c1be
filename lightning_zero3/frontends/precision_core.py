"""What zero3's precision plugins for the Trainer (``trainer/precision.py``) and Fabric (``fabric/strategy.py``) share: the
dtypes of each ``precision=`` flag (see the table in ``trainer/precision.py``), converting the module and inputs,
autocast, the sharded loss scaler and its state."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Generator, Optional

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn

from ..config.precision_flags import DTYPES, PRECISION_FLAGS, SUPPORTED_PRECISION
from ..engine import Zero3Engine
from ..engine.layout.slots import DtypePolicy
from ..engine.scaler import ShardedLossScaler
from ..errors import UnsupportedPrecisionError


def require_engine(engine: Optional[Zero3Engine]) -> Zero3Engine:
    """The engine of a door that has set up its model: the error names the call that does it."""
    if engine is None:
        raise RuntimeError(
            "zero3: no model is set up yet; call `fabric.setup(model, optimizer)` first (under the Trainer, "
            "`trainer.fit` sets it up)."
        )
    return engine


class PrecisionCore:
    """The dtypes and loss scaling of a precision flag under zero3: what the Trainer's plugin
    (``trainer/precision.py``) and Fabric's (``fabric/strategy.py``) share. A mixin placed before Lightning's base class."""

    def __init__(self, precision: str = "32-true", scaler: Optional[ShardedLossScaler] = None) -> None:
        if precision not in SUPPORTED_PRECISION:
            raise UnsupportedPrecisionError(
                f"zero3: `precision={precision!r}` is not supported; use one of {list(SUPPORTED_PRECISION)}."
            )
        flag = PRECISION_FLAGS[precision]
        if scaler is not None and not flag.loss_scaled:
            raise UnsupportedPrecisionError(f"zero3: a loss scaler only applies to '16-mixed', not {precision!r}.")
        self.precision = precision
        self.compute_dtype = flag.compute
        self.mixed = flag.mixed
        self.master_dtype = flag.master
        self.scaler = scaler or (ShardedLossScaler() if flag.loss_scaled else None)
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

    def scale_loss(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale_loss(tensor) if self.scaler is not None else tensor

    def _require_engine(self) -> Zero3Engine:
        return require_engine(self.engine)

    # -- checkpointed state -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)


def _to_dtype_if_float(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype) if torch.is_floating_point(tensor) else tensor


def translate_precision(plugin: Any, target: type, accepted: tuple) -> Any:
    """The zero3 plugin (``target``) for the plugin a framework picked from its ``precision=`` flag: one of its
    plain ``accepted`` classes with a flag zero3 supports, else a clear error."""
    if plugin is None or isinstance(plugin, target):
        return plugin
    flag = getattr(plugin, "precision", None)
    if type(plugin) in accepted and flag in SUPPORTED_PRECISION:
        return target(flag)
    raise UnsupportedPrecisionError(
        f"zero3: `precision={flag or type(plugin).__name__!r}` ({type(plugin).__name__}) is not supported by the "
        f"zero3 strategy; use one of {list(SUPPORTED_PRECISION)}."
    )
