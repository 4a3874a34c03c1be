"""``Zero3FabricPrecision``: Fabric's precision plugin under zero3, over what it shares with the Trainer's
(``frontends/precision_core.py``: the flags' dtypes, autocast, the sharded loss scaler)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Optional

import torch
from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.fabric.plugins.precision.utils import _DtypeContextManager
from torch import Tensor, nn
from torch.optim import Optimizer

from ..precision_core import PrecisionCore, translate_precision


class Zero3FabricPrecision(PrecisionCore, Precision):
    """Fabric's zero3 precision plugin: the flags of ``trainer/precision.py``'s table, the same dtypes and scaler."""

    def __init__(self, precision: str = "32-true", scaler: Any = None) -> None:
        super().__init__(precision, scaler)
        self._unscaled = False  # this step's gradients were unscaled (clipping comes before the step)
        self._found_inf = False

    def module_init_context(self) -> Any:
        return self.tensor_init_context()

    def tensor_init_context(self) -> Any:
        # under the *-true flags modules are built in the flag's dtype, as Fabric's own half precision does
        return nullcontext() if self.master_dtype == torch.float32 else _DtypeContextManager(self.master_dtype)

    def backward(self, tensor: Tensor, model: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        self.scale_loss(tensor).backward(*args, **kwargs)

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        if self.scaler is not None and not self._unscaled:
            self._found_inf = self.scaler.unscale_and_check(self._require_engine(), list(self.main_params(optimizer)))
            self._unscaled = True

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        if self.scaler is None:
            return optimizer.step(**kwargs)
        self.unscale_gradients(optimizer)
        found_inf, self._unscaled = self._found_inf, False
        result = None if found_inf else optimizer.step(**kwargs)  # every rank skips the same step
        self.scaler.update(found_inf)
        return result


def to_fabric_precision(plugin: Optional[Precision]) -> Optional[Zero3FabricPrecision]:
    """Translate the plugin Fabric picked from its ``precision=`` flag into ``Zero3FabricPrecision``."""
    return translate_precision(plugin, Zero3FabricPrecision, (Precision, MixedPrecision, HalfPrecision))
