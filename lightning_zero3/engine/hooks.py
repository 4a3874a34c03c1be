"""Module and autograd hooks: when each unit is gathered, reduced and released.

Per unit, three reasons keep its full parameters gathered; it is released when none holds:
  - ``forward_depth``: its forward is running (nested or repeated calls count separately);
  - ``backward_hold``: its backward has started and its gradients are not reduced yet;
  - ``context_holds``: a ``gathered_parameters`` block is open on it.

Forward:  pre-hook gathers; post-hook registers a pre-backward hook on the outputs and releases.
Backward: the pre-backward hook (first gradient reaching an output) re-gathers; each parameter's
          post-accumulate-grad hook counts it in; when every trainable parameter of the group has its
          gradient, the group's gradients are reduce-scattered and the unit is released.
End:      a callback queued on the autograd engine reduces what is left (parameters that got no
          gradient this step) and releases everything not held by a running forward.

[Note: forward inside backward]
Activation checkpointing re-runs a unit's forward during backward. Releasing after that forward would
free weights that the recomputed graph is about to use, and torch's non-reentrant checkpoint may stop
the recomputation early, so the post-forward hook may never run. Hence a pre-forward hook that runs
inside backward (``_current_graph_task_id() != -1``) takes a backward hold, released like any other
once the unit's gradients are reduced, and the post-forward hook does nothing there. Autograd
calls a parameter's accumulate node once per backward even when the parameter was used several times
(a module called twice, tied weights), so the gradient count stays exact; should a later gradient
arrive anyway, the end-of-backward callback reduces it (reduction adds into the shard).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils.hooks import RemovableHandle

from .comm import Communicator
from .grads import reduce_group_gradients
from .shard import FlatGroup


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class UnitRuntime:
    """The gather / release / reduce state of one flat group (a unit's, or the persistent one)."""

    def __init__(self, name: str, group: FlatGroup, comm: Communicator) -> None:
        self.name = name
        self.group = group
        self.comm = comm
        self.forward_depth = 0
        self.backward_hold = False
        self.context_holds = 0
        self.grads_ready = 0  # trainable parameters whose gradient arrived this backward

    def acquire(self) -> None:
        self.group.gather()

    def maybe_release(self) -> None:
        if self.forward_depth == 0 and not self.backward_hold and self.context_holds == 0:
            self.group.release()

    def reduce(self) -> None:
        reduce_group_gradients(self.group, self.comm)
        self.grads_ready = 0


class HookManager:
    """Installs the hooks of every unit and drives ``UnitRuntime`` from them."""

    def __init__(self, units: list[tuple[nn.Module, UnitRuntime]], persistent: Optional[UnitRuntime]) -> None:
        self.units = units
        self.persistent = persistent
        self.runtimes = [rt for _, rt in units] + ([persistent] if persistent else [])
        self._handles: list[RemovableHandle] = []
        self._final_callback_queued = False
        for module, runtime in units:
            self._handles.append(module.register_forward_pre_hook(self._pre_forward(runtime)))
            self._handles.append(module.register_forward_hook(self._post_forward(runtime)))
        for runtime in self.runtimes:
            for slot in runtime.group.trainable_slots:
                self._handles.append(slot.param.register_post_accumulate_grad_hook(self._grad_ready(runtime)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # -- forward ----------------------------------------------------------------------------------

    def _pre_forward(self, runtime: UnitRuntime) -> Callable:
        def hook(module: nn.Module, args: Any) -> None:
            if in_backward():
                # [Note: forward inside backward]
                runtime.backward_hold = True
            else:
                runtime.forward_depth += 1
            runtime.acquire()

        return hook

    def _post_forward(self, runtime: UnitRuntime) -> Callable:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if in_backward():
                return  # [Note: forward inside backward]
            runtime.forward_depth -= 1
            if torch.is_grad_enabled():
                self._register_pre_backward(runtime, output)
            runtime.maybe_release()

        return hook

    # -- backward ---------------------------------------------------------------------------------

    def _register_pre_backward(self, runtime: UnitRuntime, output: Any) -> None:
        def hook(grad: torch.Tensor) -> None:
            self._queue_final_callback()
            if not runtime.backward_hold:
                runtime.backward_hold = True
                runtime.acquire()

        for tensor in _tensors_in(output):
            if tensor.requires_grad:
                tensor.register_hook(hook)

    def _grad_ready(self, runtime: UnitRuntime) -> Callable:
        def hook(param: torch.Tensor) -> None:
            self._queue_final_callback()
            runtime.grads_ready += 1
            if runtime.grads_ready >= len(runtime.group.trainable_slots):
                runtime.reduce()
                runtime.backward_hold = False
                runtime.maybe_release()

        return hook

    def _queue_final_callback(self) -> None:
        if not self._final_callback_queued:
            self._final_callback_queued = True
            Variable._execution_engine.queue_callback(self._finish_backward)

    def _finish_backward(self) -> None:
        self._final_callback_queued = False
        for runtime in self.runtimes:
            if runtime.grads_ready > 0:
                runtime.reduce()
            runtime.backward_hold = False
            runtime.maybe_release()


def _tensors_in(output: Any) -> list[torch.Tensor]:
    """Every tensor inside a (nested) module output: tensors, lists, tuples, dicts, dataclass-like."""
    found: list[torch.Tensor] = []
    stack = [output]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return found
