"""Lightning's ``precision=`` flags that zero3 runs, and the dtypes of each: the one table everyone reads
(the precision plugins through ``frontends/precision_core.py``, the settings' checks, ``lightning-zero3
estimate``). The Trainer's plugin (``frontends/trainer/precision.py``) draws the same table for users.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrecisionFlag:
    """One ``precision=`` flag: the dtype of the master weights (and the optimizer's view of them) and the
    dtype forward and backward compute in. ``mixed``: autocast from the masters' dtype to ``compute``."""

    name: str
    master: torch.dtype
    compute: torch.dtype

    @property
    def mixed(self) -> bool:
        return self.name.endswith("-mixed")

    @property
    def loss_scaled(self) -> bool:
        """fp16 compute over fp32 masters underflows small gradients without a loss scale."""
        return self.name == "16-mixed"

    @property
    def master_bytes(self) -> int:
        return self.master.itemsize

    @property
    def compute_bytes(self) -> int:
        return self.compute.itemsize


PRECISION_FLAGS = {
    flag.name: flag
    for flag in (
        PrecisionFlag("32-true", master=torch.float32, compute=torch.float32),
        PrecisionFlag("bf16-mixed", master=torch.float32, compute=torch.bfloat16),
        PrecisionFlag("16-mixed", master=torch.float32, compute=torch.float16),
        PrecisionFlag("bf16-true", master=torch.bfloat16, compute=torch.bfloat16),
        PrecisionFlag("16-true", master=torch.float16, compute=torch.float16),
    )
}

#: Values of Lightning's ``precision=`` flag that zero3 runs.
SUPPORTED_PRECISION = tuple(PRECISION_FLAGS)

#: Lightning's short spellings of the flags (``precision=16`` is ``"16-mixed"``).
SHORT_NAMES = {"32": "32-true", "bf16": "bf16-mixed", "16": "16-mixed"}

#: Names accepted for dtype settings (``reduce_dtype``).
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def precision_flag(value: object) -> PrecisionFlag:
    """The flag ``value`` names (Lightning's short spellings included); KeyError for one zero3 does not run."""
    text = str(value)
    return PRECISION_FLAGS[SHORT_NAMES.get(text, text)]
