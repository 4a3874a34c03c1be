"""What a user's parameter is while its unit is released, and the error for touching it.

[Note: released parameters raise a clear error]
A released parameter keeps its shape, dtype and identity, but its storage is empty (see ``memory/buffers.py``).
Left alone, any read of it would fail deep inside torch with an out-of-bounds storage message. So while
released, the parameter's class is switched to ``ReleasedParameter``, whose ``__torch_function__`` lets
metadata through (shape, dtype, requires_grad, numel, ... : enough for optimizers, model summaries and
``named_parameters``) and turns every real use into ``ParameterNotGatheredError``, which names the remedy.
On gather the original class comes back, so gathered parameters cost nothing extra per operation.

[Note: a state dict of a sharded model]
``module.state_dict()`` detaches every parameter. Raising there would make the whole call fail for a
caller that wants a few small tensors only (peft's ``save_pretrained`` takes the whole state dict and
keeps the adapters, which are whole on every rank, see rule 4 in units.py). So ``detach()`` of a released
parameter gives a ``NotGathered`` value: the parameter's shape and dtype, no data (on the meta device),
and every use of it (reading it, copying it, pickling it into a file) raises the same error as the
parameter itself. Nothing is ever saved or loaded from it silently; full weights are written by
``save_full_weights`` or read inside ``gathered_parameters``.
"""

from __future__ import annotations

from typing import Any, ContextManager, Iterable

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


def _refuse(func: Any, args: tuple, kwargs: Any) -> None:
    name = getattr(func, "__name__", "")
    held = [a for a in _flat(args, kwargs) if isinstance(a, (ReleasedParameter, NotGathered))]
    label = ", ".join(sorted({_name_of(p) for p in held})) or "a sharded parameter"
    if torch.compiler.is_compiling():  # torch.compile traced code that zero3's hooks did not run before
        raise ParameterNotGatheredError(
            f"zero3: torch.compile traced {label} while it is sharded and not gathered: the compiled code bypasses "
            "the hooks that gather it (a compiled `module.forward` instead of the module). Compile the modules "
            "themselves: `block.compile()` for each block (in `configure_model`), or `torch.compile(model)`."
        )
    hint = (" To load weights into a sharded model, call `lightning_zero3.load_pretrained(module, path)` on "
            "every rank (each reads its shards)." if name in ("copy_", "load_state_dict") else "")  # fmt: skip
    raise ParameterNotGatheredError(
        f"zero3: `{name or func}` touched {label}, which is sharded across ranks and not gathered right now. "
        "Full parameters exist only while their module runs forward or backward. To read or change them "
        "elsewhere, wrap the code in `with lightning_zero3.gathered_parameters(module):` "
        "(pass `modifier_rank=0` to write changes back to the shards); to save full weights, call "
        "`lightning_zero3.save_full_weights(module, path)` on every rank." + hint
    )


class ReleasedParameter(nn.Parameter):
    """Stand-in class of a parameter whose unit is not gathered. Never constructed: assigned to ``__class__``."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        if name == "detach" and len(args) == 1 and isinstance(args[0], ReleasedParameter):
            return NotGathered.of(args[0])  # [Note: a state dict of a sharded model]
        _refuse(func, args, kwargs)

    def __repr__(self) -> str:
        return f"ReleasedParameter({_name_of(self)}, shape={tuple(self.shape)}, dtype={self.dtype})"


class NotGathered(torch.Tensor):
    """What ``detach()`` of a released parameter gives: its shape and dtype, no data; every use raises
    (see [Note: a state dict of a sharded model])."""

    @staticmethod
    def of(param: torch.Tensor) -> "NotGathered":
        with torch._C.DisableTorchFunctionSubclass():
            empty = torch.empty(param.shape, dtype=param.dtype, device="meta")
        value = torch.Tensor._make_subclass(NotGathered, empty)
        value._zero3_name = _name_of(param)
        return value

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in _METADATA and name not in ("__reduce_ex__", "__deepcopy__", "untyped_storage", "data_ptr"):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        _refuse(func, args, kwargs)

    def __repr__(self) -> str:
        return f"NotGathered({_name_of(self)}, shape={tuple(self.shape)}, dtype={self.dtype})"


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


def mark_released(params: Iterable[tuple[nn.Parameter, type]]) -> None:
    """Switch every ``(parameter, original class)`` of a unit to ``ReleasedParameter``, in one pass."""
    for param, original_class in params:
        if param.__class__ is original_class:
            param.__class__ = ReleasedParameter


def mark_gathered(params: Iterable[tuple[nn.Parameter, type]]) -> None:
    """Give every ``(parameter, original class)`` of a unit its class back, in one pass."""
    for param, original_class in params:
        if param.__class__ is ReleasedParameter:
            param.__class__ = original_class


def engine_access() -> ContextManager:
    """The engine's own reads and writes of released parameters' ``.grad`` (packing a unit's gradients,
    dropping them), in bulk: without it each one is a Python ``__torch_function__`` call that only lets
    metadata through, which on a model of many small units is most of zero3's hook work."""
    return torch._C.DisableTorchFunctionSubclass()
