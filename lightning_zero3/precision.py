"""``Zero3Precision``: the precision plugin zero3 always runs with.

Lightning hands a strategy whatever plugin the ``precision=`` flag selected; ``Zero3Strategy`` turns it
into this class (``to_zero3_precision``), as Lightning does for FSDP. It owns what a generic plugin gets
wrong on shards: clipping by norm must use the norm of the *full* gradient, so it goes through the
engine, which all-reduces the shards' partial sums. (Clipping by value is elementwise and exact on
shards: the inherited implementation is right.)
"""

from __future__ import annotations

from typing import Optional, Union

from lightning.pytorch.plugins.precision import Precision
from torch.optim import Optimizer

from .config import SUPPORTED_PRECISION, UnsupportedPrecisionError
from .engine import Zero3Engine


class Zero3Precision(Precision):
    precision = "32-true"

    def __init__(self, precision: str = "32-true") -> None:
        if precision not in SUPPORTED_PRECISION:
            raise UnsupportedPrecisionError(
                f"zero3: `precision={precision!r}` is not supported; use one of {list(SUPPORTED_PRECISION)}."
            )
        self.precision = precision
        self.engine: Optional[Zero3Engine] = None

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        if self.engine is None:
            raise RuntimeError("zero3: gradient clipping was called before the strategy set up its engine.")
        self.engine.clip_grad_norm_(float(clip_val), params=list(self.main_params(optimizer)))


def to_zero3_precision(plugin: Optional[Precision]) -> Optional[Zero3Precision]:
    """Translate the plugin Lightning picked from the ``precision=`` flag into ``Zero3Precision``."""
    if plugin is None or isinstance(plugin, Zero3Precision):
        return plugin
    if type(plugin) is Precision:  # what Lightning builds for precision="32-true"
        return Zero3Precision("32-true")
    flag = getattr(plugin, "precision", type(plugin).__name__)
    raise UnsupportedPrecisionError(
        f"zero3: `precision={flag!r}` ({type(plugin).__name__}) is not supported by the zero3 strategy; "
        f"use one of {list(SUPPORTED_PRECISION)}."
    )
