"""What a user's parameter is while its unit is released, and the error for touching it.

[Note: released parameters raise a clear error]
A released parameter keeps its shape, dtype and identity, but its storage is empty (see ``memory.py``).
Left alone, any read of it would fail deep inside torch with an out-of-bounds storage message. So while
released, the parameter's class is switched to ``ReleasedParameter``, whose ``__torch_function__`` lets
metadata through (shape, dtype, requires_grad, numel, ... : enough for optimizers, model summaries and
``named_parameters``) and turns every real use into ``ParameterNotGatheredError``, which names the remedy.
On gather the original class comes back, so gathered parameters cost nothing extra per operation.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class ParameterNotGatheredError(RuntimeError):
    """A sharded parameter was used while only its shards exist."""


# Tensor methods and properties that read metadata only: allowed on a released parameter.
_METADATA = frozenset(
    {
        "__get__",  # properties: shape, dtype, device, requires_grad, grad, is_leaf, ...
        "__set__",  # setting .grad / .requires_grad
        "size",
        "dim",
        "ndimension",
        "numel",
        "nelement",
        "element_size",
        "stride",
        "is_complex",
        "is_floating_point",
        "is_contiguous",
        "requires_grad_",
        "register_hook",
        "register_post_accumulate_grad_hook",
        "__hash__",
        "__format__",
        "__repr__",
        "__reduce_ex__",
        "__deepcopy__",
        "_is_view",
        "get_device",
        "untyped_storage",
        "data_ptr",
    }
)


class ReleasedParameter(nn.Parameter):
    """Stand-in class of a parameter whose unit is not gathered. Never constructed: assigned to ``__class__``."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        released = [a for a in _flat(args, kwargs) if isinstance(a, ReleasedParameter)]
        label = ", ".join(sorted({_name_of(p) for p in released})) or "a sharded parameter"
        raise ParameterNotGatheredError(
            f"zero3: `{name or func}` touched {label}, which is sharded across ranks and not gathered right now. "
            "Full parameters exist only while their module runs forward or backward. To read or change them "
            "elsewhere, wrap the code in `with lightning_zero3.gathered_parameters(module):` "
            "(pass `modifier_rank=0` to write changes back to the shards)."
        )

    def __repr__(self) -> str:
        return f"ReleasedParameter({_name_of(self)}, shape={tuple(self.shape)}, dtype={self.dtype})"


def _name_of(param: torch.Tensor) -> str:
    return getattr(param, "_zero3_name", None) or "a sharded parameter"


def _flat(args: tuple, kwargs: Any) -> list:
    out: list = []
    stack = list(args) + list((kwargs or {}).values())
    while stack:
        item = stack.pop()
        if isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        else:
            out.append(item)
    return out


def mark_released(param: nn.Parameter, original_class: type) -> None:
    if param.__class__ is original_class:
        param.__class__ = ReleasedParameter


def mark_gathered(param: nn.Parameter, original_class: type) -> None:
    if param.__class__ is ReleasedParameter:
        param.__class__ = original_class
