"""Sharded initialisation: a model built on the meta device becomes shards, one unit at a time.

[Note: sharded initialisation]
A model created under ``torch.device("meta")`` has shapes and dtypes but no memory. The engine plans
its units on the meta parameters as on real ones, then builds each unit's flat group in turn:

1. the unit's meta parameters become views into one fresh flat buffer (``torch.utils.swap_tensors``
   keeps every ``nn.Parameter`` the same Python object, so tied weights and later references hold);
   other meta parameters of the same modules (small, *persistent* ones) get buffers of their own;
2. on rank 0 only, each module that owns one of them is initialised: its ``reset_parameters()`` (torch's
   convention, which FSDP2 and Lightning follow: a module initialises its own direct parameters), then
   the initialiser of the library the module comes from (``initialisers.py``: Hugging Face's
   ``_init_weights``, peft's LoRA reset), then the ``init_fn(module)`` the caller passes (a model's
   custom init, such as GPT's ``std=0.02``). A module whose every meta tensor will be read from a
   checkpoint is not initialised (see [Note: loading straight into shards] in sources.py);
3. the flat buffer is broadcast from rank 0 (so every rank agrees, whatever its random state), each rank
   keeps its slice, and the unit is released before the next one is built.

So no rank ever holds more than about one unit in full (the flat buffer and its gathered copy). Buffers
(``register_buffer``) are small: a module that holds meta buffers is materialised whole up front, buffers
zero-filled and then initialised the same way, and broadcast with the other buffers.

[Note: only parameters on the meta device]
A buffer computed in ``__init__`` (a rotary embedding's ``inv_freq``, a causal mask, a custom model's
scale table) is not learned and usually not in any checkpoint: built under ``torch.device("meta")`` it
has no values, and no initialiser knows how to recompute it (a custom model's own ``__init__`` code is
the only place that says). So the strategy builds models under ``parameters_on_meta()``, as Hugging
Face's loader and accelerate's ``init_empty_weights`` do: every parameter is moved to the meta device
the moment it is registered, before the module's ``__init__`` goes on to initialise it (so
``reset_parameters()`` in ``__init__`` is a no-op, and ``torch.empty`` never touched the memory it
reserved), while everything else ``__init__`` computes, buffers included, is real.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Collection, Iterable, Iterator, Optional

import torch
from torch import nn

from .initialisers import library_initialisers

InitFn = Callable[[nn.Module], None]


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside the block get their parameters on the meta device and everything else on
    the current device (see [Note: only parameters on the meta device])."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            with torch.no_grad():
                meta = param.data.to("meta")
            module._parameters[name] = type(param)(meta, requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in _tensors(module))


def move_real_tensors(module: nn.Module, device: torch.device) -> None:
    """``module.to(device)`` for every tensor that has memory; meta tensors stay for the engine to build."""
    with torch.no_grad():
        for owner in module.modules():
            for store in (owner._parameters, owner._buffers):
                for name, tensor in store.items():
                    if tensor is not None and not tensor.is_meta and tensor.device != device:
                        if isinstance(tensor, nn.Parameter):
                            tensor.data = tensor.data.to(device)
                        else:
                            store[name] = tensor.to(device)


class Materializer:
    """Turns meta parameters into real ones, unit by unit (see [Note: sharded initialisation])."""

    def __init__(
        self, root: nn.Module, device: torch.device, init_fn: Optional[InitFn], is_source: bool,
        loaded_params: Collection[int] = (), loaded_buffers: Collection[tuple[int, str]] = (),
    ) -> None:  # fmt: skip
        self.device = device
        self.init_fn = init_fn
        self.is_source = is_source  # only the source rank (0) runs the initialisers; the rest receive
        # tensors whose values come from a checkpoint: parameters by id, buffers by (id of module, name)
        self.loaded_params = set(loaded_params)
        self.loaded_buffers = set(loaded_buffers)
        self.library_inits = library_initialisers(root)
        self.owners: dict[int, list[nn.Module]] = {}  # id(parameter) -> modules holding it directly
        for module in root.modules():
            for p in module._parameters.values():
                if p is not None:
                    self.owners.setdefault(id(p), []).append(module)
        self._done: set[int] = set()
        with torch.no_grad():
            for module in root.modules():
                if any(b is not None and b.is_meta for b in module._buffers.values()):
                    self._materialize_modules([module], {})

    def fill(self, named_params: list[tuple[str, nn.Parameter]], master: torch.Tensor) -> None:
        """Make ``named_params`` real, laid out flat in ``master`` (on the source rank: initialised)."""
        views, offset = {}, 0
        for _, p in named_params:
            views[id(p)] = master[offset : offset + p.numel()].view(p.shape)
            offset += p.numel()
        modules = {id(m): m for _, p in named_params if p.is_meta for m in self.owners.get(id(p), [])}
        with torch.no_grad():
            self._materialize_modules(list(modules.values()), views)
            for _, p in named_params:  # parameters that were real already (or made so by an earlier unit)
                target = views[id(p)]
                if p.data_ptr() != target.data_ptr():
                    target.copy_(p.detach())

    def _materialize_modules(self, modules: Iterable[nn.Module], views: dict[int, torch.Tensor]) -> None:
        fresh = [m for m in modules if id(m) not in self._done]
        to_initialise = [m for m in fresh if not self._all_loaded(m)]
        for module in fresh:
            self._done.add(id(module))
            for p in module._parameters.values():
                if p is not None and p.is_meta:
                    data = views.get(id(p))
                    if data is None:
                        data = torch.empty(p.shape, dtype=p.dtype, device=self.device)
                    # a fresh, empty parameter first, then ``.data``: the parameter keeps a version
                    # counter of its own, as one built whole does, instead of sharing the flat buffer's
                    # (which every later gather bumps, and autograd would take for an in-place change)
                    empty = nn.Parameter(torch.empty(0, dtype=p.dtype, device=self.device), p.requires_grad)
                    torch.utils.swap_tensors(p, empty)
                    p.data = data
            for name, b in module._buffers.items():
                if b is not None and b.is_meta:
                    module._buffers[name] = torch.zeros(b.shape, dtype=b.dtype, device=self.device)
        if self.is_source and to_initialise:
            for module in to_initialise:
                reset = getattr(module, "reset_parameters", None)
                if callable(reset):
                    reset()
            for initialise in self.library_inits:
                initialise(to_initialise)
            if self.init_fn is not None:
                for module in to_initialise:
                    self.init_fn(module)

    def _all_loaded(self, module: nn.Module) -> bool:
        """Whether every meta tensor ``module`` holds directly will be read from a checkpoint."""
        meta_params = [p for p in module._parameters.values() if p is not None and p.is_meta]
        meta_buffers = [name for name, b in module._buffers.items() if b is not None and b.is_meta]
        if not meta_params and not meta_buffers:
            return False
        return all(id(p) in self.loaded_params for p in meta_params) and all(
            (id(module), name) in self.loaded_buffers for name in meta_buffers
        )

    def check_done(self, root: nn.Module) -> None:
        left = [name for name, t in _named_tensors(root) if t.is_meta]
        if left:
            raise RuntimeError(f"zero3: tensors still on the meta device after sharded initialisation: {left[:5]}")


def _tensors(module: nn.Module):
    return (t for _, t in _named_tensors(module))


def _named_tensors(module: nn.Module):
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)
